"""Presses by name: ours and the kvpress baselines, built at a matched compression ratio.

A press spec is a registered name, optionally followed by ``:key=value`` settings for our presses, e.g.
``phase_aware:stagger=none:overlap=false`` (used for ablations). Values are parsed as ints, floats,
``true``/``false`` or strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

PRESS_DESCRIPTIONS = {
    "no_press": "no compression (the uncompressed control)",
    "chunked_stride": "ChunkedStridePress: fixed windows every stride tokens, each merged into k entries",
    "phase_aware": "PhaseAwarePress: the same budget, aligned grids staggered per KV head",
    "snapkv": "kvpress SnapKVPress (attention of the last window's queries)",
    "knorm": "kvpress KnormPress (key norm)",
    "streaming_llm": "kvpress StreamingLLMPress (sink + recent tokens)",
    "chunkkv": "kvpress ChunkKVPress(SnapKVPress) with chunks of stride tokens",
    "chunk": "kvpress ChunkPress(KnormPress) with chunks of stride tokens",
}
OUR_PRESSES = ("chunked_stride", "phase_aware")
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
        if name not in OUR_PRESSES:
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


def build_press(spec: PressSpec, compression_ratio: float, stride: int, window: Optional[int], offset: int):
    """The press ``spec`` at ``compression_ratio`` (None for ``no_press``)."""
    from kvpress import ChunkKVPress, ChunkPress, KnormPress, SnapKVPress, StreamingLLMPress

    from kvpress_phase import ChunkedStridePress, PhaseAwarePress

    options = dict(spec.options)
    factories: dict[str, Callable] = {
        "no_press": lambda: None,
        "chunked_stride": lambda: ChunkedStridePress(
            compression_ratio, stride=stride, window=window or stride, offset=offset, **options
        ),
        "phase_aware": lambda: PhaseAwarePress(
            compression_ratio, stride=stride, offset=offset, **({"window": window} if window else {}), **options
        ),
        "snapkv": lambda: SnapKVPress(compression_ratio),
        "knorm": lambda: KnormPress(compression_ratio),
        "streaming_llm": lambda: StreamingLLMPress(compression_ratio),
        "chunkkv": lambda: ChunkKVPress(press=SnapKVPress(compression_ratio), chunk_length=stride),
        "chunk": lambda: ChunkPress(press=KnormPress(compression_ratio), chunk_length=stride),
    }
    try:
        return factories[spec.name]()
    except TypeError as exc:  # an unknown keyword in the settings
        raise ValueError(f"invalid setting for press {spec.label!r}: {exc}") from None
