"""How kvpress's pipeline turns a context and a question into token ids, reproduced exactly.

The ``kv-press-text-generation`` pipeline (``kvpress/pipeline.py``, ``preprocess``) builds the prefill text as

* without a chat template: ``bos_token + context``, and every question becomes ``question + "\\n" + answer_prefix``;
* with a chat template: the template applied to one user message ``context + separator`` (with a generation
  prompt), split at the separator; the part before is the prefill text, the part after is the question suffix,
  and every question becomes ``question + suffix + answer_prefix``.

Both are encoded with ``tokenizer.encode(text, add_special_tokens=False)``. Phase is defined on the positions
of this prefill sequence (the BOS token or the template's opening counted), so every position reported by the
task generators is computed here.
"""

from __future__ import annotations

from typing import Sequence


def _has_chat_template(tokenizer) -> bool:
    return getattr(tokenizer, "chat_template", None) is not None


def require_fast_tokenizer(tokenizer) -> None:
    """Raise ValueError unless ``tokenizer`` is a fast (Rust ``tokenizers``) tokenizer.

    Positions are computed from the character offsets of every token (``return_offsets_mapping=True``), which
    only fast tokenizers provide.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"a fast tokenizer is required (token positions come from its offsets mapping), got "
            f"{type(tokenizer).__name__}, which is not fast; load the model's tokenizer with "
            f"AutoTokenizer.from_pretrained(..., use_fast=True) or convert it to a PreTrainedTokenizerFast"
        )


def check_tokenizer(tokenizer) -> None:
    """Raise ValueError when kvpress's pipeline or the position bookkeeping cannot use ``tokenizer``.

    Two requirements, checked before any example is generated or any model is run:

    * it is a fast tokenizer (:func:`require_fast_tokenizer`);
    * it has a chat template or a BOS token: without a chat template the pipeline prefixes every context with
      ``tokenizer.bos_token`` and fails on a tokenizer that has none.
    """
    require_fast_tokenizer(tokenizer)
    if not _has_chat_template(tokenizer) and getattr(tokenizer, "bos_token", None) is None:
        raise ValueError(
            "the tokenizer has neither a BOS token nor a chat template; kvpress's pipeline prefixes the context "
            "with the BOS token when there is no chat template, so it cannot run with this tokenizer; set "
            "tokenizer.bos_token or tokenizer.chat_template"
        )


def context_limit(tokenizer):
    """The most prefill tokens kvpress's pipeline keeps with ``tokenizer``: its ``model_max_length`` (the pipeline
    cuts a longer prefill there); None when the tokenizer sets none (transformers' placeholder, about 1e30)."""
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if isinstance(limit, int) and 0 < limit < int(1e10) else None


def prefill_layout(tokenizer, context: str, enable_thinking: bool = False) -> tuple[str, int, str]:
    """Return ``(prefill_text, context_char_start, question_suffix)`` as the pipeline builds them.

    ``prefill_text[context_char_start:context_char_start + len(context)] == context``.
    """
    if not _has_chat_template(tokenizer):
        bos = getattr(tokenizer, "bos_token", None) or ""
        return bos + context, len(bos), "\n"
    separator = "#" * (len(context) + 10)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": context + separator}],
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=enable_thinking,
    )
    before, suffix = text.split(separator)
    start = len(before) - len(context)
    if start < 0 or before[start:] != context:
        raise ValueError("the chat template does not keep the context verbatim; positions cannot be mapped")
    return before, start, suffix


def context_token_ids(tokenizer, context: str) -> list[int]:
    """Prefill token ids of ``context``, exactly as the pipeline computes ``context_ids``."""
    text, _, _ = prefill_layout(tokenizer, context)
    return list(tokenizer.encode(text, add_special_tokens=False))


def context_prefix_length(tokenizer) -> int:
    """Number of prefill tokens before the context text (1 for a BOS token, 0 without one)."""
    probe = "The sky is blue."
    text, start, _ = prefill_layout(tokenizer, probe)
    return len(tokenizer.encode(text[:start], add_special_tokens=False)) if start else 0


def question_token_ids(tokenizer, question: str, answer_prefix: str = "") -> list[int]:
    """Token ids the pipeline decodes from for one question: ``question + suffix + answer_prefix``."""
    _, _, suffix = prefill_layout(tokenizer, "")
    return list(tokenizer.encode(question + suffix + answer_prefix, add_special_tokens=False))


def encode_with_offsets(tokenizer, context: str) -> tuple[list[int], list[tuple[int, int]], int]:
    """Prefill ids, their character offsets in the prefill text, and where the context starts in that text."""
    require_fast_tokenizer(tokenizer)
    text, start, _ = prefill_layout(tokenizer, context)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if "offset_mapping" not in enc:
        raise ValueError(f"{type(tokenizer).__name__} returned no offsets mapping; a fast tokenizer is required")
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]], start


def offsets_to_token_span(
    offsets: Sequence[tuple[int, int]], char_start: int, char_end: int
) -> tuple[int, int]:
    """Tokens overlapping the character span ``[char_start, char_end)`` of the text the offsets refer to.

    Returns ``(tok_start, tok_end)``, half-open. A token overlaps when it shares at least one character with
    the span (a byte-level token such as ``" 48"`` whose offsets include the space counts).
    """
    if char_end <= char_start:
        raise ValueError(f"empty character span [{char_start}, {char_end})")
    first = last = None
    for i, (s, e) in enumerate(offsets):
        if e > s and s < char_end and e > char_start:
            if first is None:
                first = i
            last = i
    if first is None:
        raise ValueError(f"no token covers characters [{char_start}, {char_end})")
    return first, last + 1


def char_span_to_token_span(tokenizer, context: str, char_start: int, char_end: int) -> tuple[int, int]:
    """Prefill token span ``(tok_start, tok_end)`` of the characters ``context[char_start:char_end]``.

    Positions count every prefill token (the BOS token included), as the press sees them.
    """
    _, offsets, start = encode_with_offsets(tokenizer, context)
    return offsets_to_token_span(offsets, start + char_start, start + char_end)
