"""Re-placing the needles of kvpress-schema datasets (hub or local) at controlled phases, and loading them."""

from __future__ import annotations

import random
import time
import warnings

import datasets
import pytest

from kvpress_phase.evaluation.prompting import context_token_ids
from kvpress_phase.evaluation.tasks import HubDatasetError, generate, load_hub_tasks, replace_needles, vocab
from kvpress_phase.evaluation.tasks.hub import KVPRESS_COLUMNS, find_answer, needle_start
from kvpress_phase.core.phase import phase_of

LENGTH = {"word": 200, "bpe": 240, "bpe_chat": 240}


def _squash(text: str) -> str:
    return "".join(text.split()).lower()


def _hand_written_rows() -> list[dict]:
    """Rows in kvpress's schema built from the generators' vocabulary, in the shapes hub sets take."""
    rng = random.Random(7)
    lines = [" ".join(vocab.essay_sentence(rng) for _ in range(3)) for _ in range(6)]
    common = {"question": "What is the special magic number for apple in the text above?",
              "answer_prefix": "The special magic number for apple is", "task": "hand", "max_new_tokens": 8}
    # the needle starts a line, in the middle of the context
    lines_mid = lines[:3] + [vocab.NEEDLE.format(key="apple", value="48 21")] + lines[3:]
    # the needle ends the context: fewer tokens follow the answer than the padding needs
    tail = " ".join(lines) + " " + vocab.NEEDLE.format(key="apple", value="17 33")
    return [
        {**common, "context": "\n".join(lines_mid), "answer": ["48 21", "48"]},
        {**common, "context": tail, "answer": ["17 33"]},
        {**common, "context": " ".join(lines), "answer": ["99 99"]},  # answer absent: dropped
    ]


def _source(tokenizer, tok_name: str) -> list[dict]:
    rows = []
    for task in ("niah_single", "niah_multikey", "qa_single_doc"):
        ds = generate(task, tokenizer, n_samples=1, context_length=LENGTH[tok_name], stride=4, phases=[0], seed=3)
        rows += ds.select_columns(list(KVPRESS_COLUMNS)).to_list()
    rows += _hand_written_rows()
    if tok_name != "word":  # the word-level vocabulary has no upper-case "MAGIC"; a byte-level BPE reads anything
        rows.append({"context": "Notes. The special MAGIC word is here. The rest follows.", "question": "q?",
                     "answer_prefix": "", "answer": ["magic word"], "task": "hand", "max_new_tokens": 4})
    return rows


def _check(ds, source: list[dict], tokenizer, stride: int, protocol: str, offset: int) -> None:
    by_sample = {}
    for row in ds:
        src = source[row["sample_id"]]
        ids = context_token_ids(tokenizer, row["context"])
        base_length = len(context_token_ids(tokenizer, src["context"]))
        assert len(ids) == row["context_length"]
        a, b = row["answer_token_start"], row["answer_token_end"]
        n, m = row["needle_token_start"], row["needle_token_end"]
        assert 0 <= n <= a < b <= m <= len(ids)
        assert phase_of(a, stride, row["offset"]) == row["phase"]
        assert _squash(tokenizer.decode(ids[a:b])) == _squash(row["answer_span_text"])
        assert row["answer_span_text"].lower() == src["answer"][0].lower()
        assert row["answer"] == src["answer"] and row["question"] == src["question"]
        assert row["stride"] == stride and row["protocol"] == protocol
        assert tokenizer.unk_token_id not in ids
        span = src["context"].lower().find(row["answer_span_text"].lower())
        needle_text = src["context"][needle_start(src["context"], span) : span + len(row["answer_span_text"])]
        assert needle_text in row["context"]
        assert _squash(tokenizer.decode(ids[n:m])).endswith(_squash(needle_text))
        if protocol == "offset":
            assert row["context"] == src["context"] and len(ids) == base_length
        else:
            assert row["offset"] == offset
            if src["context"].endswith(vocab.NEEDLE.format(key="apple", value="17 33")):
                assert base_length <= len(ids) < base_length + stride
            else:
                assert len(ids) == base_length  # the padding is cut from the end: same length at every phase
        by_sample.setdefault(row["sample_id"], []).append(row["phase"])
    assert all(phases == list(range(stride)) for phases in by_sample.values())
    dropped = [i for i, s in enumerate(source) if s["answer"] == ["99 99"]]
    assert sorted(by_sample) == [i for i in range(len(source)) if i not in dropped]


@pytest.mark.parametrize("tok_name", ["word", "bpe", "bpe_chat"])
def test_every_row_lands_on_its_phase(tok_name, tokenizers_by_name):
    tokenizer = tokenizers_by_name[tok_name]
    source = _source(tokenizer, tok_name)
    local = datasets.Dataset.from_list(source)
    for stride in (4, 8):
        for protocol in ("prefix", "offset"):
            offset = 3 % stride if protocol == "prefix" else 0
            with pytest.warns(UserWarning, match=rf"dropped 1 of {len(source)} rows .*indices 5\)"):
                ds = replace_needles(local, tokenizer, stride=stride, phases=range(stride), protocol=protocol,
                                     offset=offset)
            _check(ds, source, tokenizer, stride, protocol, offset)


def test_same_columns_as_generate_and_extra_columns_kept(word_tokenizer):
    generated = generate("niah_single", word_tokenizer, n_samples=2, context_length=200, stride=4, phases=[1])
    rows = generated.to_list()
    rows[0]["length"] = 123
    ds = replace_needles(rows, word_tokenizer, stride=8, phases=[0, 5], seed=11)
    assert set(ds.column_names) == set(generated.column_names) | {"length"}
    assert ds["length"] == [123, 123, None, None]
    assert ds["sample_id"] == [0, 0, 1, 1] and ds["phase"] == [0, 5, 0, 5] and set(ds["seed"]) == {11}
    assert all(0.0 <= d <= 1.0 for d in ds["depth"])
    again = replace_needles(rows, word_tokenizer, stride=8, phases=[0, 5], seed=11)
    assert again["context"] == ds["context"]


def test_spans():
    text = "First one. Second line\nThe magic Number is 5. Then more."
    span = find_answer(text, "number is 5")
    assert text[span[0] : span[1]] == "Number is 5"
    assert text[needle_start(text, span[0]) : span[1]] == "The magic Number is 5"
    assert find_answer(text, " Second ") == (11, 17)
    assert text[needle_start(text, 11) :].startswith("Second")
    assert needle_start(text, 3) == 0
    assert find_answer(text, "absent") is None and find_answer(text, "  ") is None


def test_invalid_arguments(word_tokenizer):
    rows = _hand_written_rows()
    for kwargs, name in [
        ({"stride": 0, "phases": [0]}, "stride"),
        ({"stride": 4, "phases": [4]}, "phases"),
        ({"stride": 4, "phases": []}, "phases"),
        ({"stride": 4, "phases": [0], "protocol": "pad"}, "protocol"),
        ({"stride": 4, "phases": [0], "offset": 4}, "offset"),
        ({"stride": 4, "phases": [0], "filler_words": ["zzzz"]}, "filler"),
    ]:
        with pytest.raises(ValueError, match=name):
            replace_needles(rows, word_tokenizer, **kwargs)
    with pytest.raises(ValueError, match="max_new_tokens"):
        replace_needles([{k: v for k, v in rows[0].items() if k != "max_new_tokens"}], word_tokenizer,
                        stride=4, phases=[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="no row"):
            replace_needles(rows[2:], word_tokenizer, stride=4, phases=[0])


@pytest.fixture
def offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_load_unknown_hub_id_fails_fast_and_clearly(offline, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    t0 = time.monotonic()
    with pytest.raises(HubDatasetError, match=r"kvpress-phase-tests/no-such-set.*offline") as info:
        load_hub_tasks("kvpress-phase-tests/no-such-set", "4096")
    assert time.monotonic() - t0 < 15
    assert isinstance(info.value, ConnectionError) and isinstance(info.value, ValueError)


def test_load_local_files(offline, tmp_path, word_tokenizer):
    rows = _hand_written_rows()[:2]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "ruler.parquet"))
    ds.to_json(str(tmp_path / "ruler.jsonl"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "saved_dict"))
    for path in ("ruler.parquet", "ruler.jsonl", "saved", "saved_dict"):
        loaded = load_hub_tasks(str(tmp_path / path))
        assert loaded.to_list() == rows, path
    with pytest.raises(HubDatasetError, match="no split 'validation'"):
        load_hub_tasks(str(tmp_path / "saved_dict"), split="validation")
    placed = replace_needles(load_hub_tasks(str(tmp_path / "ruler.parquet")), word_tokenizer, stride=4, phases=range(4))
    assert len(placed) == 8
    whole = load_hub_tasks(str(tmp_path / "ruler.jsonl"), split=None)
    assert isinstance(whole, datasets.DatasetDict) and list(whole) == ["test"]
    with pytest.raises(HubDatasetError, match="no such local file"):
        load_hub_tasks(str(tmp_path / "missing.parquet"))
