"""Tokenizers for the evaluation tests: the built-in word-level one, and byte-level BPEs trained here."""

from __future__ import annotations

import random

import pytest
import torch

torch.set_num_threads(1)

from kvpress_phase.evaluation.tasks import vocab  # noqa: E402
from kvpress_phase.evaluation.tokenizer import build_tokenizer, save_tokenizer  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

CHAT_TEMPLATE = (
    "{% for m in messages %}<|user|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _corpus(n: int = 400) -> list[str]:
    rng = random.Random(1234)
    lines = []
    for _ in range(n):
        needle = vocab.NEEDLE.format(key=rng.choice(vocab.KEYS), value=vocab.random_value(rng))
        lines.append(vocab.essay_sentence(rng) + " " + needle)
    lines.append(" ".join(vocab.NOISE_SENTENCES))
    return lines


def train_bpe(vocab_size: int = 600, chat: bool = False):
    """A byte-level BPE trained on generated text: many words of the task vocabulary split into pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"] + (["<|user|>", "<|assistant|>"] if chat else [])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def word_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def bpe_tokenizer():
    return train_bpe()


@pytest.fixture(scope="session")
def bpe_chat_tokenizer():
    return train_bpe(chat=True)


@pytest.fixture(scope="session")
def tokenizers_by_name(word_tokenizer, bpe_tokenizer, bpe_chat_tokenizer):
    return {"word": word_tokenizer, "bpe": bpe_tokenizer, "bpe_chat": bpe_chat_tokenizer}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A folder holding a tiny random-weight Llama and the built-in word-level tokenizer."""
    path = tmp_path_factory.mktemp("model")
    tok = build_tokenizer()
    tiny_model("llama", vocab_size=len(tok)).save_pretrained(path)
    save_tokenizer(tok, str(path))
    return str(path)


@pytest.fixture(scope="module")
def unloadable_model(tmp_path_factory):
    """A folder that passes the check of ``--model`` (config, tokenizer and weights files are there) and whose
    tokenizer loads, but whose model does not (its ``config.json`` names no architecture): a command given it is
    refused at the model's load, after every check of its configuration, and runs nothing."""
    path = tmp_path_factory.mktemp("unloadable")
    save_tokenizer(build_tokenizer(), str(path))
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return str(path)
