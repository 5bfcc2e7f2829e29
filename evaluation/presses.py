"""Presses by name: ours and the kvpress baselines, built at a matched compression ratio.

A press spec is a registered name, optionally followed by ``:key=value`` settings for our presses, e.g.
``phase_aware:stagger=none:overlap=false`` (used for ablations), or a ``scorer=`` for kvpress's chunk wrappers
(``chunk:scorer=keydiff``). Values are parsed as ints, floats,
``true``/``false`` or strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

PRESS_DESCRIPTIONS = {
    "no_press": "no compression (the uncompressed control)",
    "chunked_stride": "ChunkedStridePress: fixed windows every stride tokens, each keeps its k best tokens by KeyDiff score (:mode=pool merges them into k entries)",
    "phase_aware": "PhaseAwarePress: the same cache length, the row's best tokens by KeyDiff score wherever they are (no fixed budget per window)",
    "snapkv": "kvpress SnapKVPress (attention of the last 64 prefill tokens' queries)",
    "knorm": "kvpress KnormPress (key norm)",
    "streaming_llm": "kvpress StreamingLLMPress (sink + recent tokens)",
    "chunkkv": "kvpress ChunkKVPress(SnapKVPress) with chunks of stride tokens (:scorer=NAME wraps another scorer)",
    "chunk": "kvpress ChunkPress(KnormPress) with chunks of stride tokens (:scorer=NAME wraps another scorer)",
    "expected_attention": "kvpress ExpectedAttentionPress (attention expected from future queries, extrapolated from the last hidden states)",
    "tova": "kvpress TOVAPress (attention of the last prefill token)",
    "keydiff": "kvpress KeyDiffPress (keys least similar to the mean key)",
    "pyramidkv": "kvpress PyramidKVPress (SnapKV scores, budgets shrinking with depth)",
    "kvzip": "kvpress KVzipPress (attention while the model repeats the context; global budget across layers and heads, evicted entries masked, not removed)",
}
QUESTION_READERS = {"snapkv", "chunkkv", "tova", "pyramidkv", "expected_attention"}
"""kvpress presses whose scores read the last prefill tokens' queries or hidden states, so the question when it is
compressed with the context (``--compress-question``); KnormPress, KeyDiffPress, StreamingLLMPress and ChunkPress
read keys or positions only, and KVzip scores by reconstructing the context, whatever its end."""
MASKING_PRESSES = {"kvzip"}
"""kvpress presses that keep every entry and mask the evicted ones during decoding (``module.masked_key_indices``),
so their cache is not shorter: their cache length is reported as the entries left unmasked."""
OUR_PRESSES = ("chunked_stride", "phase_aware")

CHUNK_PRESSES = {"chunk": "knorm", "chunkkv": "snapkv"}
"""kvpress's chunk wrappers (``ChunkPress``, ``ChunkKVPress``; chunks of ``stride`` tokens from the first token) and
their default scorer. ``chunk:scorer=keydiff`` wraps another scorer of
:data:`~kvpress_phase.presses.scorers.SCORERS` (the phase audit of kvpress's chunked presses runs them this way)."""

CHUNK_SCORERS = ("knorm", "keydiff", "snapkv", "tova", "expected_attention")
"""Scorers a chunk wrapper accepts by name (KVzip scores whole contexts, not chunks; random scores are no baseline)."""

QUESTION_SCORERS = {"snapkv", "tova", "expected_attention"}
"""Scorer names whose scores read the last prefill tokens, hence the question under ``--query-aware``."""


def reads_question(spec: "PressSpec") -> bool:
    """Whether the press ``spec`` sees the question when it is compressed with the context: the kvpress presses of
    :data:`QUESTION_READERS`, and ours when their scores do (a question-aware ``scorer=`` such as SnapKV's, for
    ``PhaseAwarePress`` or for selection and score weighting in ``ChunkedStridePress``; the defaults' KeyDiff scores do
    not read it)."""
    if spec.name in CHUNK_PRESSES:
        return dict(spec.options).get("scorer", CHUNK_PRESSES[spec.name]) in QUESTION_SCORERS
    if spec.name in QUESTION_READERS:
        return True
    if spec.name not in OUR_PRESSES:
        return False
    press = build_press(spec, 0.5, 8, None, 0)
    return press.needs_scores and type(press.scorer).__name__ in ("SnapKVScorer", "SnapKVPress", "TOVAPress",
                                                                   "ExpectedAttentionPress")
PHASE_GRID_PRESSES = OUR_PRESSES  # presses whose grid offset the offset-shift protocol moves


@dataclass(frozen=True)
class PressSpec:
    name: str
    options: tuple = ()

    @property
    def label(self) -> str:
        return self.name + "".join(f":{k}={v}" for k, v in self.options)


def _parse_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_press_spec(text: str) -> PressSpec:
    """``name[:key=value...]`` to a :class:`PressSpec`; ValueError naming the problem otherwise."""
    name, *settings = text.strip().split(":")
    if name not in PRESS_DESCRIPTIONS:
        raise ValueError(f"unknown press {name!r}; valid presses: {', '.join(PRESS_DESCRIPTIONS)}")
    options = []
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"press setting {item!r} in {text!r} must look like key=value")
        if name in CHUNK_PRESSES:
            if key != "scorer" or value not in CHUNK_SCORERS:
                raise ValueError(f"press {name!r} takes only scorer=NAME with NAME one of {', '.join(CHUNK_SCORERS)} "
                                 f"(got {item!r})")
        elif name not in OUR_PRESSES:
            raise ValueError(f"press {name!r} takes no settings (got {item!r})")
        if key == "decoding":
            raise ValueError(
                f"press setting {item!r}: the phase evaluation replays the prefill's compression and decodes its "
                "short answers without press hooks, so decoding compression would not apply"
            )
        options.append((key, _parse_value(value)))
    spec = PressSpec(name, tuple(options))
    build_press(spec, 0.5, 8, None, 0)  # validate the settings now, not mid-run
    return spec


def matched_ratio(context_length: int, stride: int, compression_ratio: float) -> float:
    """The compression ratio at which a kvpress scorer press keeps exactly as many entries as
    ``ChunkedStridePress(compression_ratio, stride=stride)`` (default ``n_sink`` and ``n_local``) does for
    ``context_length`` tokens. kvpress keeps ``int(n * (1 - ratio))`` entries (whole chunks of it for ChunkKV); the
    half entry keeps ``int`` exact against rounding."""
    from kvpress_phase import ChunkedStridePress
    from kvpress_phase.phase import compressed_length

    ref = ChunkedStridePress(compression_ratio, stride=stride, window=stride)
    kept = compressed_length(context_length, stride, compression_ratio, ref.n_sink, ref.n_local)
    return min(max((context_length - kept - 0.5) / context_length, 0.0), 0.999999)


def build_press(spec: PressSpec, compression_ratio: float, stride: int, window: Optional[int], offset: int,
                *, matched_context_length: Optional[int] = None):
    """The press ``spec`` at ``compression_ratio`` (None for ``no_press``).

    With ``matched_context_length``, the kvpress baselines run at :func:`matched_ratio` for that many tokens
    instead of the nominal ratio, so that they keep as many entries as ``ChunkedStridePress`` does.
    """
    from kvpress import (ChunkKVPress, ChunkPress, ExpectedAttentionPress, KeyDiffPress, KnormPress, PyramidKVPress,
                         SnapKVPress, StreamingLLMPress, TOVAPress)

    from kvpress_phase.presses.scorers import SCORERS, quiet_kvzip_press

    from kvpress_phase import ChunkedStridePress, PhaseAwarePress

    options = dict(spec.options)  # our presses build a scorer= name from kvpress_phase.presses.scorers.SCORERS

    def chunk_scorer(default):  # the scorer a chunk wrapper wraps: its default, or scorer=NAME
        return SCORERS[options["scorer"]](base_ratio) if "scorer" in options else default(base_ratio)

    base_ratio = compression_ratio
    if matched_context_length is not None and spec.name not in OUR_PRESSES and compression_ratio > 0:
        base_ratio = matched_ratio(matched_context_length, stride, compression_ratio)
    factories: dict[str, Callable] = {
        "no_press": lambda: None,
        "chunked_stride": lambda: ChunkedStridePress(
            compression_ratio, stride=stride, window=window or stride, offset=offset, **options
        ),
        "phase_aware": lambda: PhaseAwarePress(
            compression_ratio, stride=stride, offset=offset, **({"window": window} if window else {}), **options
        ),
        "snapkv": lambda: SnapKVPress(base_ratio),
        "knorm": lambda: KnormPress(base_ratio),
        "streaming_llm": lambda: StreamingLLMPress(base_ratio),
        "chunkkv": lambda: ChunkKVPress(press=chunk_scorer(SnapKVPress), chunk_length=stride),
        "chunk": lambda: ChunkPress(press=chunk_scorer(KnormPress), chunk_length=stride),
        "expected_attention": lambda: ExpectedAttentionPress(base_ratio),
        "tova": lambda: TOVAPress(base_ratio),
        "keydiff": lambda: KeyDiffPress(base_ratio),
        "pyramidkv": lambda: PyramidKVPress(base_ratio),
        "kvzip": lambda: quiet_kvzip_press(base_ratio),
    }
    try:
        return factories[spec.name]()
    except TypeError as exc:  # an unknown keyword in the settings
        raise ValueError(f"invalid setting for press {spec.label!r}: {exc}") from None

