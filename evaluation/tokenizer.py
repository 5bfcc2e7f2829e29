"""The word-level tokenizer of the project's small built-in model.

Its vocabulary is exactly the set of word and punctuation types the task generators can emit
(:func:`kvpress_phase.evaluation.tasks.vocab.word_types`) plus four special tokens. Text is split on spaces;
punctuation (``. , : ; ? ! =``) and the newline are tokens of their own. Decoding joins tokens with single
spaces, so ``"The special magic number for apple is 48 21."`` decodes to
``"The special magic number for apple is 48 21 ."``; answers never contain punctuation, so a correct answer is
always a substring of the decoded output.

There is no chat template: kvpress's pipeline then prefixes the context with the BOS token text and appends
``"\\n"`` to each question, and both are single tokens here.
"""

from __future__ import annotations

import json
import os

from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .tasks.vocab import PUNCTUATION, word_types

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
"""Special tokens, with ids 0, 1, 2, 3."""


def vocabulary() -> dict[str, int]:
    """Token -> id: the special tokens first, then every word type in sorted order."""
    tokens = SPECIAL_TOKENS + word_types()
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the word-level tokenizer (deterministic: the same ids every time)."""
    model = models.WordLevel(vocab=vocabulary(), unk_token=UNK)
    tok = Tokenizer(model)
    punct = "".join("\\" + c if c in r"\^-]" else c for c in PUNCTUATION)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[^\S\n]+"), behavior="removed"),
            pre_tokenizers.Split(Regex(r"\n|[" + punct + "]"), behavior="isolated"),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: str) -> None:
    """``save_pretrained`` plus a ``special_tokens_map.json``, loadable offline by ``AutoTokenizer``.

    ``tokenizer_config.json`` names the generic ``PreTrainedTokenizerFast`` class, so that transformers 4.x
    (which has no ``TokenizersBackend``) loads the saved folder as well.
    """
    tokenizer.save_pretrained(directory)
    config_path = os.path.join(directory, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    special = {
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
    }
    with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2, sort_keys=True)
