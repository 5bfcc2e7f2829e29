"""Placement with a byte-level BPE whose words are whole tokens, and tokenizers that cannot be used.

The BPE here is trained on lines of the task generators' own words, so that, as in production vocabularies,
most words are one token and a word after a space is a different token from the same word after a newline or
at the start of a line ("ĠParagraph" and "Paragraph"). Filler inserted before a needle must not turn one into
the other: the first answer token has to be the same token at every phase of a sample.
"""

from __future__ import annotations

import random

import pytest

from kvpress_phase.evaluation.prompting import check_tokenizer, context_token_ids
from kvpress_phase.evaluation.tasks import TASKS, generate, replace_needles, training_example, vocab
from kvpress_phase.core.phase import phase_of

ALL_TASKS = list(TASKS)
LENGTH = 360
STRIDE = 8
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(n_lines: int = 3000, words_per_line: int = 14, seed: int = 0) -> list[str]:
    """Lines of random task words (punctuation glued to the word before), twenty lines per training text."""
    rng = random.Random(seed)
    words = [w for w in vocab.word_types() if w != "\n"]
    texts = []
    for _ in range(n_lines // 20):
        lines = []
        for _ in range(20):
            line = ""
            for w in rng.sample(words, words_per_line):
                line += w if (w in vocab.PUNCTUATION or not line) else " " + w
            lines.append(line)
        texts.append("\n".join(lines))
    return texts


def train_word_bpe(bos: bool = True, chat_template: str | None = None):
    """A byte-level BPE (GPT-2 pre-tokenization, no prefix space) whose frequent words are single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    specials = {"eos_token": "<|endoftext|>"}
    if bos:
        specials["bos_token"] = "<|endoftext|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="module")
def bpe():
    return train_word_bpe()


@pytest.fixture(scope="module")
def bpe_chatml():
    return train_word_bpe(chat_template=CHATML)


def _first_word_token(tokenizer, text: str) -> str:
    """The token that holds the first character of "Paragraph" in ``text``."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    p = text.index("Paragraph")
    i = next(i for i, (s, e) in enumerate(enc["offset_mapping"]) if s <= p < e)
    return tokenizer.convert_ids_to_tokens(enc["input_ids"][i])


def test_the_bpe_tells_a_word_after_a_space_from_one_after_a_newline(bpe):
    """The property that makes filler placement delicate (otherwise the tests below prove little)."""
    after_newline = _first_word_token(bpe, "end.\nParagraph 3:")
    after_space = _first_word_token(bpe, "end. Paragraph 3:")
    assert after_newline != after_space and after_space == "ĠParagraph"


def _check_sample(rows, tokenizer, protocol):
    first_ids, answers, needles = set(), set(), set()
    for row in rows:
        ids = context_token_ids(tokenizer, row["context"])
        a, b = row["answer_token_start"], row["answer_token_end"]
        n, m = row["needle_token_start"], row["needle_token_end"]
        assert len(ids) == row["context_length"] == LENGTH
        assert 0 <= n <= a < b <= m <= len(ids)
        assert phase_of(a, STRIDE, row["offset"]) == row["phase"]
        # the answer's tokens hold the answer and nothing else but whitespace before it
        assert tokenizer.decode(ids[a:b]).strip() == row["answer_span_text"]
        first_ids.add(ids[a])
        answers.add(tuple(ids[a:b]))
        needles.add(tuple(ids[n:m]))
    assert [r["phase"] for r in rows] == list(range(STRIDE))
    assert len(first_ids) == 1, "the first answer token differs between phases"
    assert len(answers) == 1 and len(needles) == 1
    if protocol == "offset":
        assert len({r["context"] for r in rows}) == 1


@pytest.mark.parametrize("protocol", ["prefix", "offset"])
@pytest.mark.parametrize("task", ALL_TASKS)
def test_answer_token_is_the_same_at_every_phase(task, protocol, bpe, bpe_chatml):
    """All 9 tasks, both protocols, with a BOS token and with a ChatML template; depth 0 puts the needle first."""
    for tokenizer in (bpe, bpe_chatml):
        for depth in (None, 0.0) if protocol == "prefix" else (None,):
            ds = generate(task, tokenizer, n_samples=2, context_length=LENGTH, stride=STRIDE, phases=range(STRIDE),
                          protocol=protocol, offset=3 if protocol == "prefix" else 0, seed=4, depth=depth)
            for sid in (0, 1):
                _check_sample([r for r in ds if r["sample_id"] == sid], tokenizer, protocol)


def test_passage_label_keeps_its_line_start_token(bpe):
    """The label of passage_retrieval follows its newline at every phase, so it is never "ĠParagraph"."""
    ds = generate("passage_retrieval", bpe, n_samples=1, context_length=LENGTH, stride=STRIDE, phases=range(STRIDE))
    for row in ds:
        ids = context_token_ids(bpe, row["context"])
        assert bpe.convert_ids_to_tokens(ids[row["answer_token_start"]]) != "ĠParagraph"
        label = row["answer"][0]
        assert row["context"].startswith(label) or f"\n{label}:" in row["context"]


def test_a_padding_that_changes_the_answer_token_is_refused(bpe, monkeypatch):
    """With the filler forced after the separator, the label's token changes: generate says so."""
    from kvpress_phase.evaluation.tasks.base import Assembler

    monkeypatch.setattr(Assembler, "choose_filler_layout", lambda self: None)
    with pytest.raises(RuntimeError, match="changes the answer's tokens"):
        generate("passage_retrieval", bpe, n_samples=1, context_length=LENGTH, stride=STRIDE, phases=range(STRIDE))


def test_generators_and_hub_share_one_placement(word_tokenizer, monkeypatch):
    """generate and replace_needles place every row through placement.place_answer, which refuses an unknown
    protocol by name and a padding that never lands on the phase."""
    from kvpress_phase.evaluation.tasks import placement
    from kvpress_phase.evaluation.tasks.base import Placed

    calls = []
    real = placement.place_answer

    def counted(example, phase, stride, protocol, offset):
        calls.append(type(example).__name__)
        return real(example, phase, stride, protocol, offset)

    import kvpress_phase.evaluation.tasks as tasks
    from kvpress_phase.evaluation.tasks import hub

    monkeypatch.setattr(tasks, "place_answer", counted)
    monkeypatch.setattr(hub, "place_answer", counted)
    rows = generate("niah_single", word_tokenizer, n_samples=1, context_length=200, stride=4, phases=[0, 3])
    replace_needles(rows.to_list()[:1], word_tokenizer, stride=4, phases=[1, 2], protocol="offset")
    assert calls == ["Assembler", "Assembler", "_Row", "_Row"]

    class Stuck:  # every padding leaves the answer where it was
        n_filler = 64

        def padded(self, n_pad):
            return Placed("x", 10, (0, 5), (5, 6), token_ids=tuple(range(10)))

        unpadded = lambda self: self.padded(0)  # noqa: E731

    with pytest.raises(ValueError, match="protocol must be one of"):
        real(Stuck(), 0, 4, "suffix", 0)
    with pytest.raises(RuntimeError, match="could not place the answer at phase 2"):
        real(Stuck(), 2, 4, "prefix", 0)
    assert real(Stuck(), 2, 4, "offset", 0)[1] == 3


def _longbench_style_rows(n_rows: int = 3) -> list[dict]:
    """Passage-retrieval rows shaped like LongBench's: "Paragraph N: ..." blocks, the answer a label."""
    rng = random.Random(5)
    rows = []
    for i in range(n_rows):
        paragraphs = [f"Paragraph {j + 1}: " + " ".join(vocab.essay_sentence(rng) for _ in range(3)) for j in range(6)]
        target = 1 + i
        rows.append({"context": ("\n\n" if i % 2 else "\n").join(paragraphs), "question": "Which paragraph?",
                     "answer_prefix": "The answer is", "answer": [f"Paragraph {target + 1}"], "task": "hand",
                     "max_new_tokens": 6})
    return rows


def test_replace_needles_keeps_the_answer_token_at_every_phase(bpe, bpe_chatml):
    """Re-placed hub rows whose answer starts a line: the filler goes before the line break."""
    source = _longbench_style_rows()
    for tokenizer in (bpe, bpe_chatml):
        ds = replace_needles(source, tokenizer, stride=STRIDE, phases=range(STRIDE), offset=2)
        for sid in range(len(source)):
            rows = [r for r in ds if r["sample_id"] == sid]
            firsts = set()
            for row in rows:
                ids = context_token_ids(tokenizer, row["context"])
                a, b = row["answer_token_start"], row["answer_token_end"]
                assert len(ids) == row["context_length"] == len(context_token_ids(tokenizer, source[sid]["context"]))
                assert phase_of(a, STRIDE, row["offset"]) == row["phase"]
                assert tokenizer.decode(ids[a:b]).strip() == row["answer_span_text"] == source[sid]["answer"][0]
                firsts.add(ids[a])
            assert len(rows) == STRIDE and len(firsts) == 1


# ------------------------------------------------------------------------------------------ unusable tokenizers
def _slow_tokenizer():
    from transformers import ByT5Tokenizer

    tok = ByT5Tokenizer()
    assert not tok.is_fast
    return tok


@pytest.mark.parametrize("tokenizer", [_slow_tokenizer(), object()], ids=["slow", "not-a-tokenizer"])
def test_tokenizer_without_offsets_is_refused_up_front(tokenizer):
    with pytest.raises(ValueError, match="a fast tokenizer is required"):
        check_tokenizer(tokenizer)
    with pytest.raises(ValueError, match="a fast tokenizer is required"):
        generate("niah_single", tokenizer, n_samples=1, context_length=200, stride=8, phases=[0])
    with pytest.raises(ValueError, match="a fast tokenizer is required"):
        training_example("niah_single", tokenizer, 0, 200)
    rows = [{"context": "Filler text. The code is 42. More text.", "question": "What is the code?",
             "answer_prefix": "Answer:", "answer": ["42"], "task": "niah_single", "max_new_tokens": 4}]
    with pytest.raises(ValueError, match="a fast tokenizer is required"):
        replace_needles(rows, tokenizer, stride=4, phases=[0])


def test_tokenizer_without_bos_or_chat_template_is_refused_up_front(bpe):
    from kvpress.pipeline import KVPressTextGenerationPipeline

    no_bos = train_word_bpe(bos=False)
    assert no_bos.bos_token is None and no_bos.chat_template is None
    # what kvpress's pipeline would do with it, after the whole set had been generated
    pipe = KVPressTextGenerationPipeline.__new__(KVPressTextGenerationPipeline)
    pipe.tokenizer = no_bos
    with pytest.raises(TypeError):
        pipe.preprocess("Some context.", ["A question?"], "", max_context_length=10**6)
    message = "neither a BOS token nor a chat template"
    with pytest.raises(ValueError, match=message):
        generate("niah_single", no_bos, n_samples=1, context_length=LENGTH, stride=8, phases=[0])
    rows = [{"context": "Filler text. The code is 42. More text.", "question": "What is the code?",
             "answer_prefix": "Answer:", "answer": ["42"], "task": "niah_single", "max_new_tokens": 4}]
    with pytest.raises(ValueError, match=message):
        replace_needles(rows, no_bos, stride=4, phases=[0])
    # a chat template is enough: the pipeline does not use the BOS token then
    no_bos.chat_template = CHATML
    check_tokenizer(no_bos)
    row = generate("niah_single", no_bos, n_samples=1, context_length=LENGTH, stride=8, phases=[5])[0]
    assert len(context_token_ids(no_bos, row["context"])) == LENGTH


def test_run_evaluation_refuses_before_writing_anything(tmp_path):
    from kvpress_phase.evaluation.config import EvalConfig
    from kvpress_phase.evaluation.runner import run_evaluation

    out = tmp_path / "run"
    config = EvalConfig(tasks=["niah_single"], presses=["no_press"], strides=[4], context_lengths=[128], samples=1)
    with pytest.raises(ValueError, match="a fast tokenizer is required"):
        run_evaluation(config, None, _slow_tokenizer(), str(out), progress=False)
    assert not out.exists()
