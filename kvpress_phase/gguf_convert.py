"""GGUF files to transformers folders, with a tokenizer that kvpress's pipeline can trust.

transformers reads GGUF files (``from_pretrained(folder, gguf_file=...)``) and dequantizes their weights, but the
tokenizer it builds from a GGUF's byte-level BPE vocabulary is not the model's: for SmolLM2 it is labelled
``CodeLlamaTokenizer``, its post-processor prepends ``<|im_start|>`` to every encode (the chat template already
opens with it, so the token arrives twice), its EOS is ``<|im_start|>`` instead of the end-of-turn ``<|im_end|>``,
``add_prefix_space`` is set, the decoder mixes SentencePiece steps with byte-level ones, and five tokens are added
past the model's vocabulary. A model answering through that tokenizer never stops where its chat template ends a
turn, and every position a phase is computed from shifts by one.

:func:`convert_gguf` therefore converts the weights with transformers and builds the tokenizer itself from the
GGUF's own vocabulary, merges and pre-tokenizer name (byte-level BPE, nothing prepended, EOS the chat template's
end-of-turn token, the GGUF's chat template). Whatever tokenizer a conversion ends with, :func:`check_tokenizer`
runs on it before anything is written, and refuses (:class:`ConversionError`, a ``ValueError``) when

* encoding adds a token (the pipeline's chat template already holds every special token a prompt needs);
* EOS differs from the token the chat template ends a turn with;
* a text does not decode back to itself.

The folder is written by the caller (:mod:`kvpress_phase.model_cache`, which also caches it).
"""

from __future__ import annotations

import functools
import json
import os
from contextlib import contextmanager
from typing import Callable, Optional

# llama.cpp's pre-tokenizer names (``tokenizer.ggml.pre``) for byte-level BPE vocabularies, and the split that each
# names: single digits split off before GPT-2's pattern (StarCoder family, SmolLM), GPT-2's pattern alone, Llama 3's
# pattern (digits in groups of up to three), or Qwen2's (Llama 3's with every digit on its own, the text NFC-normalised
# first).
_LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                   r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                  r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
_SPLIT_PATTERNS = {"llama3": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN}
_NFC_NORMALISED = frozenset({"qwen2"})
"""Kinds whose text is NFC-normalised before it is split."""
PRE_TOKENIZERS = {
    "default": "gpt2",
    "gpt-2": "gpt2",
    "gpt2": "gpt2",
    "smollm": "digits+gpt2",
    "starcoder": "digits+gpt2",
    "refact": "digits+gpt2",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "qwen2": "qwen2",
}
"""Byte-level BPE pre-tokenizers this conversion builds, by the GGUF's ``tokenizer.ggml.pre`` name."""

ROUND_TRIP_TEXTS = (
    "The special magic number for tangerine is 7304521.",
    "  Leading spaces, trailing spaces  ",
    "Line one\nLine two\n\n\tTabbed: a=1, b=22, c=333; 4.5e-6",
    "Ünïcödé — “quotes”, emoji 🙂, CJK 漢字, Ελληνικά",
    "def f(x):\n    return x ** 2  # comment",
)
"""Texts every converted tokenizer must decode back to exactly."""


class ConversionError(ValueError):
    """A GGUF file that cannot be converted into a usable transformers folder (the message says why)."""


# ------------------------------------------------------------------------------------------------ reading
def read_metadata(gguf_path: str) -> dict:
    """The GGUF's metadata fields (tensors are not read) as Python values."""
    try:
        from gguf import GGUFReader
    except ImportError:  # pragma: no cover - gguf is a dependency
        raise ConversionError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    try:
        reader = GGUFReader(gguf_path)
    except (OSError, ValueError) as exc:
        raise ConversionError(f"{gguf_path!r} is not a readable GGUF file: {exc}") from None
    fields = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            fields[name] = field.contents()
        except Exception:  # noqa: BLE001 - an exotic field type we do not need
            continue
    return fields


# ------------------------------------------------------------------------------------------------ tokenizer
def end_of_turn_token(chat_template: str, special_tokens: list[str]) -> Optional[str]:
    """The special token the chat template closes a user turn with (``<|im_end|>`` for ChatML), or None."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    marker = "kvpress-phase-marker"
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        text = env.from_string(chat_template).render(
            messages=[{"role": "user", "content": marker}], add_generation_prompt=False,
            bos_token="", eos_token="")
    except Exception as exc:  # noqa: BLE001 - a template we cannot render
        raise ConversionError(f"the GGUF's chat template cannot be rendered: {exc}") from None
    rest = text[text.index(marker) + len(marker):] if marker in text else ""
    for token in sorted(special_tokens, key=len, reverse=True):
        if rest.startswith(token):
            return token
    return None


def _pre_tokenizer(kind: str):
    from tokenizers import Regex, pre_tokenizers

    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERNS[kind]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def build_bpe_tokenizer(metadata: dict, model_max_length: int):
    """A ``PreTrainedTokenizerFast`` built from a byte-level BPE GGUF's vocabulary, merges and pre-tokenizer name.

    Nothing is prepended or appended on encode; BOS, EOS, UNK and padding are the GGUF's ids, except EOS, which is
    the chat template's end-of-turn token when the template has one, and BOS, which is left out when the file never
    prepends it and the chat template never writes it. Qwen2's pre-tokenizer NFC-normalises the text first.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ConversionError(
            f"the GGUF's byte-level BPE tokenizer uses the pre-tokenizer {pre!r}, which this conversion does not "
            f"know (known: {', '.join(sorted(PRE_TOKENIZERS))}); tokenizing with another pre-tokenizer would give "
            "the model token sequences it was not trained on")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    if PRE_TOKENIZERS[pre] in _NFC_NORMALISED:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _pre_tokenizer(PRE_TOKENIZERS[pre])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # control (3) and user-defined (4) tokens are matched whole, before the BPE model sees the text
    special = [tokens[i] for i, t in enumerate(types) if t in (3, 4)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    def token(key):
        idx = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    template = metadata.get("tokenizer.chat_template")
    eos = (end_of_turn_token(template, special) if template else None) or token("eos")
    bos = token("bos")
    if bos and template and bos not in template and not metadata.get("tokenizer.ggml.add_bos_token", True):
        # never prepended, never written by the chat template: no token the model begins with (Qwen2's files name
        # <|endoftext|> here; Qwen2's own tokenizer has no BOS)
        bos = None
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token=token("unknown"),
        pad_token=token("padding") or eos, model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )
    if template:
        tokenizer.chat_template = template
    return tokenizer


def check_tokenizer(tokenizer, source: str = "the GGUF file") -> None:
    """Refuse a tokenizer the pipeline cannot trust (:class:`ConversionError` naming the failed check)."""
    probe = "Hello world. 12345"
    plain = tokenizer.encode(probe, add_special_tokens=False)
    added = tokenizer.encode(probe, add_special_tokens=True)
    if added != plain:
        extra = tokenizer.convert_ids_to_tokens([i for i in added if i not in plain][:3]) or added[:3]
        raise ConversionError(
            f"the tokenizer converted from {source} adds {extra} to every encode; the chat template already "
            "opens each prompt, so the token would arrive twice")
    template = getattr(tokenizer, "chat_template", None)
    if template:
        eot = end_of_turn_token(template, list(tokenizer.all_special_tokens) + list(tokenizer.added_tokens_encoder))
        if eot is not None and tokenizer.eos_token != eot:
            raise ConversionError(
                f"the tokenizer converted from {source} has EOS {tokenizer.eos_token!r}, but its chat template ends "
                f"a turn with {eot!r}; generation would not stop where an answer ends")
    for text in ROUND_TRIP_TEXTS:
        back = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=False)
        if back != text:
            raise ConversionError(
                f"the tokenizer converted from {source} does not round-trip text: {text!r} decodes to {back!r}")


# ------------------------------------------------------------------------------------------------ conversion
@contextmanager
def quiet_transformers():
    """transformers' own progress bars off while the block runs (restored after): its logging's (loading the
    weights, writing the shards) and the GGUF reader's per-tensor bar, a plain ``tqdm`` that transformers does not let
    one turn off (transformers 5.2: ``modeling_gguf_pytorch_utils.tqdm``). A first use prints one bar of its own
    instead (:class:`kvpress_phase.model_cache.StepBar`), not hundreds of lines into logs and notebook outputs."""
    from transformers.utils import logging as hf_logging

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_reader
    except ImportError:  # another layout: only the logging's bars are turned off
        gguf_reader = None
    bar = getattr(gguf_reader, "tqdm", None)
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_reader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_reader.tqdm = bar
        if enabled:
            hf_logging.enable_progress_bar()


CONVERT_STEPS = 3
"""The steps :func:`convert_gguf` reports through its ``step`` callback: the tokenizer, the weights, the folder."""


def convert_gguf(gguf_path: str, output_dir: str, progress: bool = True,
                 step: Optional[Callable[[str], None]] = None) -> dict:
    """Write a transformers folder (float32 safetensors weights, config, generation config, tokenizer) for the GGUF
    file ``gguf_path`` into ``output_dir`` and return what was done (saved as ``conversion.json`` there).

    The tokenizer is checked (:func:`check_tokenizer`) before any weight is read, so a refused file costs seconds.
    transformers' own progress bars stay off (:func:`quiet_transformers`); ``step(text)``, when given, is called as
    each of the :data:`CONVERT_STEPS` steps starts (``progress`` is kept for callers; the steps are the progress).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    step = step or (lambda text: None)
    step("reading the tokenizer")
    metadata = read_metadata(gguf_path)
    arch = metadata.get("general.architecture")
    if arch is None:
        raise ConversionError(f"{gguf_path!r} has no general.architecture: not a model GGUF file")
    max_length = int(metadata.get(f"{arch}.context_length", 2048))
    folder, name = os.path.split(os.path.abspath(gguf_path))
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = build_bpe_tokenizer(metadata, max_length)
        repaired = True
    else:  # SentencePiece-style vocabularies: transformers' own conversion, checked like ours
        try:
            with quiet_transformers():
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds here
            raise ConversionError(f"transformers cannot build a tokenizer from {gguf_path!r}: {exc}") from None
        repaired = False
    check_tokenizer(tokenizer, os.path.basename(gguf_path))

    step("de-quantising the weights to float32")
    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001
        raise ConversionError(f"transformers cannot read the weights of {gguf_path!r}: {exc}") from None
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    model.config.eos_token_id = eos_id
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id,
                                               pad_token_id=tokenizer.pad_token_id)
    step("writing the transformers folder")
    os.makedirs(output_dir, exist_ok=True)
    with quiet_transformers():
        model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    info = {
        "source": os.path.basename(gguf_path),
        "architecture": arch,
        "name": metadata.get("general.name"),
        "license": metadata.get("general.license"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer": "rebuilt from the GGUF's byte-level BPE vocabulary" if repaired else "transformers' conversion",
        "pre_tokenizer": metadata.get("tokenizer.ggml.pre"),
        "eos_token": tokenizer.eos_token,
        "context_length": max_length,
    }
    with open(os.path.join(output_dir, "conversion.json"), "w") as fh:
        json.dump(info, fh, indent=2)
    return info
