"""GGUF conversion offline: a tiny Llama written to a GGUF file here, converted back, compared with its source."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from kvpress_phase.gguf_convert import ROUND_TRIP_TEXTS, ConversionError, check_tokenizer, convert_gguf
from tiny_models import write_tiny_gguf


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    source = write_tiny_gguf(str(folder / "tiny.gguf"))
    info = convert_gguf(str(folder / "tiny.gguf"), str(folder / "out"), progress=False)
    return source, str(folder / "out"), info


def test_logits_equal_the_source_model(converted):
    source, out, _ = converted
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, source.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, rtol=0, atol=1e-5)


def test_repaired_tokenizer(converted):
    _, out, info = converted
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.is_fast
    assert tok.eos_token == "<|im_end|>" != "<|im_start|>"  # the file's EOS is <|im_start|>, the template's <|im_end|>
    assert tok.bos_token == "<|im_start|>"
    assert info["eos_token"] == "<|im_end|>"
    for text in ROUND_TRIP_TEXTS:
        ids = tok.encode(text)  # add_special_tokens defaults to True: nothing may be added
        assert ids == tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # special tokens are matched whole, and the chat template is the file's
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids.count(ids[0]) == 2
    # digits split one by one (SmolLM2's pre-tokenizer)
    assert tok.tokenize(" 123") == ["Ġ", "1", "2", "3"]
    config = json.load(open(os.path.join(out, "generation_config.json")))
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")


def test_qwen2_pre_tokenizer(tmp_path):
    """Qwen2's split: every digit on its own, one non-letter joined to the letters after it, contractions in any case;
    the text NFC-normalised first. Its files' BOS (``<|endoftext|>``) is never prepended nor written by the chat
    template, so the tokenizer has none."""
    write_tiny_gguf(str(tmp_path / "qwen.gguf"), pre="qwen2", bos_id=0)
    info = convert_gguf(str(tmp_path / "qwen.gguf"), str(tmp_path / "out"), progress=False)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert info["pre_tokenizer"] == "qwen2" and tok.eos_token == "<|im_end|>" and tok.bos_token is None
    backend = tok.backend_tokenizer
    assert backend.normalizer.normalize_str("cafe\u0301") == "caf\u00e9"
    pieces = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("x=(abc 2024) I'M ok")]
    assert pieces == ["x", "=(", "abc", "Ġ", "2", "0", "2", "4", ")", "ĠI", "'M", "Ġok"]
    text = "Caf\u00e9 2024: x = f(12) ; I'M"
    assert tok.decode(tok.encode(text)) == text and tok.encode(text) == tok.encode(text, add_special_tokens=False)


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    write_tiny_gguf(str(tmp_path / "odd.gguf"), pre="some-new-model")
    with pytest.raises(ConversionError, match="pre-tokenizer 'some-new-model'"):
        convert_gguf(str(tmp_path / "odd.gguf"), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ConversionError, match="not a readable GGUF file"):
        convert_gguf(str(tmp_path / "x.gguf"), str(tmp_path / "out"), progress=False)


def _word_tokenizer():
    vocab = {"<s>": 0, "</s>": 1, "<eot>": 2, "<unk>": 3, "hello": 4, "world.": 5, "12345": 6}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return backend


def test_check_tokenizer_refuses_a_prepending_tokenizer():
    backend = _word_tokenizer()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    with pytest.raises(ConversionError, match="adds"):
        check_tokenizer(tok)


def test_check_tokenizer_refuses_an_eos_that_does_not_end_a_turn():
    from tiny_models import CHATML_TEMPLATE

    backend = _word_tokenizer()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<|im_start|>")
    tok.chat_template = CHATML_TEMPLATE
    with pytest.raises(ConversionError, match="ends a turn with '<\\|im_end\\|>'"):
        check_tokenizer(tok)


def test_check_tokenizer_refuses_a_lossy_tokenizer():
    backend = _word_tokenizer()
    backend.normalizer = normalizers.Lowercase()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    with pytest.raises(ConversionError, match="round-trip"):
        check_tokenizer(tok)
