"""The built-in word-level tokenizer and the pipeline's prompt layout."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kvpress_phase.evaluation.prompting import (
    char_span_to_token_span,
    context_prefix_length,
    context_token_ids,
    prefill_layout,
    question_token_ids,
)
from kvpress_phase.evaluation.tasks import vocab
from kvpress_phase.evaluation.tokenizer import SPECIAL_TOKENS, build_tokenizer, save_tokenizer, vocabulary


def test_vocabulary_is_deterministic_and_modest(word_tokenizer):
    assert vocabulary() == vocabulary()
    assert build_tokenizer().get_vocab() == word_tokenizer.get_vocab()
    assert 1000 <= len(word_tokenizer) <= 2500
    assert [word_tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert (word_tokenizer.pad_token, word_tokenizer.bos_token, word_tokenizer.eos_token, word_tokenizer.unk_token) == (
        "<pad>",
        "<bos>",
        "<eos>",
        "<unk>",
    )
    assert word_tokenizer.chat_template is None
    assert len(word_tokenizer.get_vocab()) == len(vocab.word_types()) + 4


def test_newline_and_punctuation_are_single_tokens(word_tokenizer):
    for piece in list(vocab.PUNCTUATION) + ["\n"]:
        ids = word_tokenizer.encode(piece, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] != word_tokenizer.unk_token_id
    ids = word_tokenizer.encode("VAR apple = 48 21.\nWhere does Anna live?", add_special_tokens=False)
    assert word_tokenizer.convert_ids_to_tokens(ids) == [
        "VAR", "apple", "=", "48", "21", ".", "\n", "Where", "does", "Anna", "live", "?",
    ]  # fmt: skip


def test_round_trip_and_answer_substring(word_tokenizer):
    text = "The special magic number for apple is 48 21. The sky is blue.\nAnna lives in Paris."
    ids = word_tokenizer.encode(text, add_special_tokens=False)
    decoded = word_tokenizer.decode(ids)
    assert decoded == "The special magic number for apple is 48 21 . The sky is blue . \n Anna lives in Paris ."
    assert word_tokenizer.encode(decoded, add_special_tokens=False) == ids
    for answer in ["48 21", "Paris", "apple"]:
        assert answer.lower() in decoded.lower()
    assert word_tokenizer.decode([word_tokenizer.bos_token_id] + ids[:2], skip_special_tokens=True) == "The special"


def test_unknown_words_map_to_unk(word_tokenizer):
    ids = word_tokenizer.encode("The zyzzyva is blue.", add_special_tokens=False)
    assert ids[1] == word_tokenizer.unk_token_id and ids.count(word_tokenizer.unk_token_id) == 1


def test_bos_handling_matches_the_pipeline(word_tokenizer):
    context = "The grass is green. The sky is blue."
    text, start, suffix = prefill_layout(word_tokenizer, context)
    assert text == "<bos>" + context and start == 5 and suffix == "\n"
    ids = context_token_ids(word_tokenizer, context)
    assert ids[0] == word_tokenizer.bos_token_id and ids == word_tokenizer.encode(text, add_special_tokens=False)
    assert context_prefix_length(word_tokenizer) == 1
    assert char_span_to_token_span(word_tokenizer, context, 0, 3) == (1, 2)  # "The"
    at = context.index("blue.")
    assert char_span_to_token_span(word_tokenizer, context, at, at + 5) == (9, 11)  # "blue" "."
    q = question_token_ids(word_tokenizer, "Where does Anna live?", "Anna lives in")
    assert word_tokenizer.convert_ids_to_tokens(q)[-4:] == ["\n", "Anna", "lives", "in"]

    from kvpress.pipeline import KVPressTextGenerationPipeline

    pipe = KVPressTextGenerationPipeline.__new__(KVPressTextGenerationPipeline)
    pipe.tokenizer = word_tokenizer
    out = pipe.preprocess(context, ["Where does Anna live?"], "Anna lives in", max_context_length=10**6)
    assert out["context_ids"][0].tolist() == ids
    assert out["questions_ids"][0][0].tolist() == q


def test_chat_template_layout(bpe_chat_tokenizer):
    context = "The grass is green."
    text, start, suffix = prefill_layout(bpe_chat_tokenizer, context)
    assert text == "<|user|>\n" + context and text[start:] == context
    assert suffix == "\n<|assistant|>\n"
    n = context_prefix_length(bpe_chat_tokenizer)
    ids = context_token_ids(bpe_chat_tokenizer, context)
    assert n == len(bpe_chat_tokenizer.encode("<|user|>\n", add_special_tokens=False))
    s, e = char_span_to_token_span(bpe_chat_tokenizer, context, 0, 3)
    assert s == n and bpe_chat_tokenizer.decode(ids[s:e]).strip() == "The"


def test_save_and_load_offline(word_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    save_tokenizer(word_tokenizer, str(tmp_path))
    names = {p.name for p in tmp_path.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "<bos>The special magic number for apple is 48 21.\n"
    assert loaded.encode(text, add_special_tokens=False) == word_tokenizer.encode(text, add_special_tokens=False)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id, loaded.unk_token_id) == (1, 2, 0, 3)
    assert loaded.chat_template is None
    assert loaded.decode(loaded.encode("Anna lives in Paris.", add_special_tokens=False)) == "Anna lives in Paris ."
    # plain save_pretrained loads back as well
    plain = tmp_path / "plain"
    word_tokenizer.save_pretrained(str(plain))
    assert AutoTokenizer.from_pretrained(str(plain)).get_vocab() == word_tokenizer.get_vocab()


@pytest.mark.parametrize("text", ["", "   ", "\n\n"])
def test_edge_texts(word_tokenizer, text):
    ids = word_tokenizer.encode(text, add_special_tokens=False)
    assert word_tokenizer.unk_token_id not in ids
    assert len(ids) == text.count("\n")
