"""What the two windowed presses share: parameters, their validation, and the compress step.

A subclass decides only where each row's window grid starts (:meth:`WindowedPress.grid_offsets`) and which
window length it uses (:attr:`WindowedPress.effective_window`); everything else, from the layout to the kernel
call, is here.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from kvpress import BasePress, KeyDiffPress, ScorerPress
from kvpress.presses.base_press import is_prefilling
from torch import nn

from kvpress_phase.kernels import BACKENDS, ROPE_MODES, WEIGHTINGS, Compressed, pool_windows, select_windows
from kvpress_phase.phase import (WindowLayout, check_number, check_ratio, group_bounds, kept_per_window,
                                 ratio_mismatch, window_ratio)
from kvpress_phase.presses import decoding as _decoding
from kvpress_phase.presses.scorers import SCORERS, scorer_from_name
from kvpress_phase.presses.stats import LayerStats
from kvpress_phase.rope import rotary_inv_freq

logger = logging.getLogger(__name__)

MODES = ("select", "pool")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


@dataclass
class WindowedPress(BasePress):
    """Common base of :class:`ChunkedStridePress` and :class:`PhaseAwarePress` (see their docstrings)."""

    compression_ratio: float = 0.0
    window: Optional[int] = None
    stride: int = 8
    offset: int = 0
    n_sink: int = 4
    n_local: int = 16
    mode: str = "select"
    scorer: ScorerPress = field(default_factory=KeyDiffPress)
    weighting: str = "mean"
    rope: str = "start"
    backend: Optional[str] = None
    decoding: bool = False
    stats: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    decoding_state: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _warned_ratio: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.validate()

    def __setattr__(self, name, value):
        if name == "scorer" and isinstance(value, str):  # a name, as in an evaluation press spec: build it
            value = scorer_from_name(value)
        super().__setattr__(name, value)
        if name == "decoding":  # kvpress's pipeline keeps only PrefillDecodingPress instances active while generating
            _decoding.sync_decoding_class(self, value is True)

    # ------------------------------------------------------------------ parameters
    @property
    def effective_window(self) -> int:
        return self.stride if self.window is None else self.window

    @property
    def k(self) -> int:
        """Entries each window yields: the integer nearest ``stride * (1 - compression_ratio)``, ties to more
        compression, ``<= stride - 1`` for a positive ratio, ``>= 1`` (:func:`~kvpress_phase.phase.kept_per_window`)."""
        return kept_per_window(self.stride, self.compression_ratio)

    @property
    def window_ratio(self) -> float:
        """The per-window compression ratio this press achieves, ``1 - k / stride``."""
        return window_ratio(self.stride, self.compression_ratio)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid parameter and its allowed range."""
        check_ratio(self.compression_ratio)
        check_number("stride", self.stride, 1)
        if self.stride == 1 and self.compression_ratio > 0:
            raise ValueError(f"stride must be >= 2 for compression_ratio={self.compression_ratio:g}: at stride 1 every "
                             "window is one token and keeps it, so nothing would be compressed")
        if self.window is not None:
            check_number("window", self.window, self.stride)
        check_number("offset", self.offset, 0)
        check_number("n_sink", self.n_sink, 0)
        check_number("n_local", self.n_local, 0)
        _check_choice("mode", self.mode, MODES)
        _check_choice("weighting", self.weighting, WEIGHTINGS)
        _check_choice("rope", self.rope, ROPE_MODES)
        if self.backend is not None:
            _check_choice("backend", self.backend, BACKENDS)
        if not isinstance(self.decoding, bool):
            raise ValueError(f"decoding must be True or False, got {self.decoding!r}")
        if not isinstance(self.scorer, ScorerPress):
            raise ValueError(f"scorer must be a kvpress ScorerPress or one of the names {', '.join(SCORERS)}, got "
                             f"{type(self.scorer).__name__}")
        if self.decoding and getattr(self.scorer, "needs_context", False):
            raise ValueError(f"decoding=True cannot use {type(self.scorer).__name__}: its scores need the whole "
                             "context, which a decoding step does not have")
        if self.mode == "select" and self.effective_window != self.stride:
            raise ValueError(
                f"window must equal stride ({self.stride}) in mode='select' (got {self.effective_window}): "
                "overlapping windows would keep a token twice; use mode='pool' for overlapping windows"
            )
        self._warn_ratio()

    def _warn_ratio(self) -> None:
        """Warn once per press and setting when the per-window ratio achieved is not the one asked for."""
        setting = (self.stride, self.compression_ratio)
        if self._warned_ratio == setting:
            return
        self._warned_ratio = setting
        message = ratio_mismatch(self.stride, self.compression_ratio)
        if message:
            warnings.warn(f"{type(self).__name__}: {message}; press.stats[layer].window_ratio records it",
                          UserWarning, stacklevel=5)

    @property
    def needs_rope(self) -> bool:
        return self.mode == "pool" and self.rope != "none"

    @property
    def needs_scores(self) -> bool:
        return self.mode == "select" or self.weighting == "score"

    # ------------------------------------------------------------------ kvpress hooks
    def post_init_from_model(self, model):
        self._check_model(model)
        self.scorer.post_init_from_model(model)
        if self.needs_rope:
            inner = getattr(model, "model", model)
            inner = getattr(inner, "language_model", inner)
            if getattr(inner, "rotary_emb", None) is None:
                raise ValueError(
                    f"{type(model).__name__} has no rotary embedding: rope={self.rope!r} un-rotates keys with the "
                    "model's RoPE. Use rope='none' for this model."
                )

    def _check_model(self, model) -> None:
        """Refuse, when the press is attached, a model whose attention layers kvpress cannot hook: kvpress (and
        :func:`_compress_after_prefill`) find them at ``model.model.layers[i].self_attn`` and hand each the model's
        ``model.model.rotary_emb``, which only its rotary decoders have (GPT-2, for one, has neither). The
        embedding may be None where nothing un-rotates keys (selection, or ``rope="none"``)."""
        inner = getattr(model, "model", None)
        inner = getattr(inner, "language_model", inner)
        layers = getattr(inner, "layers", None)
        missing = [path for path, ok in (
            ("model.model.rotary_emb", hasattr(inner, "rotary_emb")),
            ("model.model.layers[i].self_attn", layers is not None and all(hasattr(m, "self_attn") for m in layers)),
        ) if not ok]
        if missing:
            raise ValueError(
                f"{type(self).__name__} needs a model with rotary position embeddings whose attention layers kvpress "
                "can hook, as in Llama, Mistral, Qwen2/3, Phi3 and Gemma3 (model.model.rotary_emb and "
                f"model.model.layers[i].self_attn); {type(model).__name__} has no {' and no '.join(missing)}"
            )

    def grid_offsets(
        self, module: nn.Module, scores: Optional[torch.Tensor], batch: int, heads: int, seq_len: int
    ) -> Union[int, torch.Tensor]:
        """Offset of each row's window grid: one int, or a tensor broadcastable to ``(batch, heads)``."""
        return self.offset

    def layout_for(self, module: nn.Module, keys: torch.Tensor, scores: Optional[torch.Tensor] = None) -> WindowLayout:
        """The window layout this press uses for ``keys`` (``(batch, heads, seq_len, head_dim)``) in ``module``."""
        batch, heads, seq_len, _ = keys.shape
        return WindowLayout.build(
            seq_len,
            window=self.effective_window,
            stride=self.stride,
            k=self.k,
            offsets=self.grid_offsets(module, scores, batch, heads, seq_len),
            n_sink=self.n_sink,
            n_local=self.n_local,
            batch=batch,
            heads=heads,
            device=keys.device,
        )

    def compress(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor,
        kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.validate()
        layer_idx = getattr(module, "layer_idx", 0)
        seq_len = keys.shape[2]
        self._check_positions(hidden_states, seq_len)
        if self.compression_ratio == 0:
            self.stats[layer_idx] = LayerStats(seq_len, seq_len, 0.0, None, None, requested_ratio=0.0,
                                               window_ratio=0.0)
            if self.decoding:
                _decoding.start(self, module, None, seq_len, kwargs)
            return keys, values

        def score():
            return self.scorer.score(module, hidden_states, keys, values, attentions, kwargs).float()

        scores = score() if self.needs_scores_for_grid else None
        layout = self.layout_for(module, keys, scores)
        if self.decoding:
            _decoding.start(self, module, layout, layout.compressed_length, kwargs)
        if layout.n_windows == 0:  # too short for one window: nothing to score or compress
            self.stats[layer_idx] = LayerStats(seq_len, seq_len, 0.0, None, None,
                                               requested_ratio=self.compression_ratio, window_ratio=0.0)
            return keys, values
        if scores is None and self.needs_scores:
            scores = score()

        out = self.compress_windows(module, keys, values, scores, layout)
        ends = out.ends if out.ends is not None else self._entry_ends(layout, out.positions)
        self.stats[layer_idx] = LayerStats(
            seq_len, layout.compressed_length, layout.achieved_ratio, layout, out.positions.to(torch.int32),
            ends.to(torch.int32), requested_ratio=self.compression_ratio, window_ratio=self.window_ratio,
        )
        return out.keys, out.values

    def compress_windows(self, module: nn.Module, keys: torch.Tensor, values: torch.Tensor,
                         scores: Optional[torch.Tensor], layout: WindowLayout) -> Compressed:
        """The kernel call: every window of ``layout`` becomes its ``k`` entries."""
        if self.mode == "select":
            return select_windows(keys, values, scores, layout, backend=self.backend)
        inv_freq = rotary_inv_freq(module) if self.needs_rope else None
        return pool_windows(keys, values, layout, scores=scores, weighting=self.weighting, rope=self.rope,
                            inv_freq=inv_freq, backend=self.backend)

    @contextlib.contextmanager
    def __call__(self, model):
        """kvpress's context manager (compression during the prefill), except with a scorer that needs the whole
        context (``scorer.needs_context``, e.g. :class:`~kvpress_phase.presses.scorers.KVzipScorer`): then the
        prefill runs uncompressed, the scorer scores the finished context, and every layer's cache is compressed
        when the context manager exits, to the same exact length."""
        if not getattr(self.scorer, "needs_context", False):
            with BasePress.__call__(self, model):
                yield
            return
        with _compress_after_prefill(self, model):
            yield

    def forward_hook(self, module: nn.Module, input, kwargs: dict, output):
        if self.decoding and not is_prefilling(kwargs["cache_position"], kwargs["hidden_states"].shape[1]):
            return _decoding.decode_step(self, module, kwargs, output)
        return BasePress.forward_hook(self, module, input, kwargs, output)

    def reset(self) -> None:
        """Kept for kvpress's ``PrefillDecodingPress``, which calls it whenever its context exits: the decoding
        state of each layer belongs to the cache its prefill compressed and is replaced by the next prefill, so the
        prefill's context exiting must not drop it."""

    def _check_positions(self, hidden_states: Optional[torch.Tensor], seq_len: int) -> None:
        """Refuse a cache that another press has already shortened: its indices are no longer token positions."""
        if hidden_states is None or hidden_states.dim() != 3 or seq_len >= hidden_states.shape[1]:
            return
        name = type(self).__name__
        raise ValueError(
            f"{name} received {seq_len} keys for {hidden_states.shape[1]} tokens: another press has already "
            f"shortened this layer's cache, so a key's index is no longer its position and {name}'s windows, phases "
            f"and RoPE re-rotation would be wrong. Put {name} first: ComposedPress([{name}(...), other_press]) "
            "works, the other press then prunes the compressed cache."
        )

    def _entry_ends(self, layout: WindowLayout, positions: torch.Tensor) -> torch.Tensor:
        ends = positions + 1
        if self.mode == "pool":
            lo, hi = group_bounds(layout.window, layout.stride, layout.k)
            size = torch.tensor([h - l for l, h in zip(lo, hi)], device=positions.device)
            entry = (torch.arange(layout.compressed_length, device=positions.device) - layout.first[..., None])
            entry_size = size[entry.clamp(min=0) % layout.k]
            ends = torch.where(layout.window_slot_mask(), (positions + entry_size).clamp(max=layout.seq_len), ends)
        return ends

    @property
    def needs_scores_for_grid(self) -> bool:
        return False


@contextlib.contextmanager
def _compress_after_prefill(press: WindowedPress, model):
    """Record each attention layer's prefill inputs, let the prefill finish uncompressed, have the press's scorer
    score the whole context (``scorer.compute(model, context_ids, cache)``), then compress every layer's cache."""
    from transformers import QuantizedCache

    press.post_init_from_model(model)
    language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
    records: dict = {}
    seen: dict = {}

    def record(module, args, kwargs, output):
        if is_prefilling(kwargs["cache_position"], kwargs["hidden_states"].shape[1]):
            kept = ("position_embeddings", "cache_position", "position_ids")
            records[module.layer_idx] = (module, {k: v for k, v in kwargs.items() if k in kept})

    original = language_model.forward

    def forward(*args, **kwargs):
        seen["ids"] = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        seen["cache"] = kwargs.get("past_key_values")
        return original(*args, **kwargs)

    hooks = []
    language_model.forward = forward
    try:
        for layer in language_model.layers:
            layer.self_attn.rotary_emb = language_model.rotary_emb
            hooks.append(layer.self_attn.register_forward_hook(record, with_kwargs=True))
        yield
    finally:
        del language_model.forward
        for hook in hooks:
            hook.remove()
    cache, ids = seen.get("cache"), seen.get("ids")
    if not records or cache is None:
        return
    if isinstance(cache, QuantizedCache):
        raise ValueError(f"{type(press.scorer).__name__} compresses after the prefill, which a QuantizedCache does "
                         "not support here; use a DynamicCache")
    if ids.shape[0] != 1:
        raise ValueError(f"{type(press.scorer).__name__} scores one context at a time (batch 1), got {ids.shape[0]}")
    press.scorer.compute(model, ids, cache)
    for layer_idx, (module, kwargs) in sorted(records.items()):
        layer = cache.layers[layer_idx]
        layer.keys, layer.values = press.compress(module, None, layer.keys, layer.values, None, kwargs)
