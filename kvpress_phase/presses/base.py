"""What the windowed presses share: the grid's parameters, their validation, and the compress step.

Every press here is a kvpress ``BasePress`` whose :meth:`WindowedPress.compress` runs the same four steps:

1. **score** the tokens with ``scorer`` (:meth:`WindowedPress.score`; skipped when the press needs no scores);
2. **lay out** the windows (:meth:`WindowedPress.layout_for`: where each row's grid starts, how many windows fit
   between the protected sink and local tokens; :class:`~kvpress_phase.core.phase.WindowLayout`);
3. **choose or merge** (:meth:`WindowedPress.compress_windows`, the one method each press defines: which entries
   the windows yield);
4. **record** what it did in ``press.stats[layer]`` (:class:`~kvpress_phase.presses.stats.LayerStats`).

:func:`fixed_windows` is step 3 for the presses that give every window the same ``k`` slots (select the ``k`` best
tokens, or pool the window into ``k`` entries). A scorer that needs the whole context (KVzip's reconstruction,
``scorer.needs_context``) cannot score during the prefill: the press then compresses every layer when the prefill
has finished (:meth:`WindowedPress.__call__`), from what forward hooks recorded.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from kvpress import BasePress, ScorerPress
from kvpress.presses.base_press import is_prefilling
from torch import nn

from kvpress_phase.kernels import BACKENDS, ROPE_MODES, WEIGHTINGS, Compressed, pool_windows, select_windows
from kvpress_phase.core.phase import (WindowLayout, check_number, check_ratio, group_bounds, kept_per_window,
                                 ratio_mismatch, window_ratio)
from kvpress_phase.presses.scorers import SCORERS, KeyDiffScorer, scorer_from_name, token_scores
from kvpress_phase.presses.stats import LayerStats
from kvpress_phase.presses.storage import decoding_attention
from kvpress_phase.core.rope import rotary_inv_freq

MODES = ("select", "pool")
RESIDUALS = ("drop", "pool")
"""What happens to the tokens a score-chosen budget does not keep: dropped, or pooled into entries."""


def check_choice(name: str, value, choices) -> None:
    """ValueError naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


@dataclass
class WindowedPress(BasePress):
    """Common base of the windowed presses (:class:`~kvpress_phase.ChunkedStridePress`,
    :class:`~kvpress_phase.PhaseAwarePress`, :class:`~kvpress_phase.StaggeredWindowPress`); see their docstrings
    for the parameters."""

    compression_ratio: float = 0.0
    stride: int = 8
    offset: int = 0
    n_sink: int = 4
    n_local: int = 16
    scorer: ScorerPress = field(default_factory=KeyDiffScorer)
    backend: Optional[str] = None
    stats: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _warned_ratio: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.scorer, str):  # a name of SCORERS, as in an evaluation press spec
            self.scorer = scorer_from_name(self.scorer)
        self.validate()

    # ------------------------------------------------------------------ parameters
    @property
    def effective_window(self) -> int:
        """Tokens each window reads: ``stride`` unless a press lets windows overlap."""
        return self.stride

    @property
    def k(self) -> int:
        """Entries each window yields: the integer nearest ``stride * (1 - compression_ratio)``, ties to more
        compression, ``<= stride - 1`` for a positive ratio, ``>= 1`` (:func:`~kvpress_phase.core.phase.kept_per_window`)."""
        return kept_per_window(self.stride, self.compression_ratio)

    @property
    def window_ratio(self) -> float:
        """The per-window compression ratio this press achieves, ``1 - k / stride``."""
        return window_ratio(self.stride, self.compression_ratio)

    @property
    def needs_scores(self) -> bool:
        """Whether step 3 reads the scorer's scores."""
        return True

    @property
    def needs_scores_for_grid(self) -> bool:
        """Whether step 2 reads them (a grid that follows the content)."""
        return False

    @property
    def needs_rope(self) -> bool:
        """Whether the press un-rotates keys with the model's rotary embedding (pooled entries)."""
        return False

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid parameter and its allowed range."""
        check_ratio(self.compression_ratio)
        check_number("stride", self.stride, 1)
        if self.stride == 1 and self.compression_ratio > 0:
            raise ValueError(f"stride must be >= 2 for compression_ratio={self.compression_ratio:g}: at stride 1 every "
                             "window is one token and keeps it, so nothing would be compressed")
        check_number("offset", self.offset, 0)
        check_number("n_sink", self.n_sink, 0)
        check_number("n_local", self.n_local, 0)
        if self.backend is not None:
            check_choice("backend", self.backend, BACKENDS)
        if not isinstance(self.scorer, ScorerPress):
            raise ValueError(f"scorer must be a kvpress ScorerPress or one of the names {', '.join(SCORERS)}, got "
                             f"{type(self.scorer).__name__}")
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

    # ------------------------------------------------------------------ kvpress hooks
    def post_init_from_model(self, model):
        _check_model(self, model)
        self.scorer.post_init_from_model(model)
        if self.needs_rope:
            inner = getattr(model, "model", model)
            inner = getattr(inner, "language_model", inner)
            if getattr(inner, "rotary_emb", None) is None:
                raise ValueError(
                    f"{type(model).__name__} has no rotary embedding: rope={self.rope!r} un-rotates keys with the "
                    "model's RoPE. Use rope='none' for this model."
                )

    @contextlib.contextmanager
    def __call__(self, model):
        """kvpress's context manager (compression during the prefill), except with a scorer that needs the whole
        context (``scorer.needs_context``, e.g. :class:`~kvpress_phase.presses.scorers.KVzipScorer`): then the
        prefill runs uncompressed, the scorer scores the finished context, and every layer's cache is compressed
        when the context manager exits, to the same exact length. A cache that plain SDPA cannot decode afterwards
        (layers of different lengths) has the model decode it with the package's attention while it is alive
        (:func:`~kvpress_phase.presses.storage.decoding_attention`)."""
        with compressing(self, model):
            yield

    def reset(self) -> None:
        """Kept for kvpress's ``PrefillDecodingPress``, which calls it whenever its context exits: what a press
        records belongs to the prefill it compressed and is replaced by the next one."""

    # ------------------------------------------------------------------ the compress step
    def score(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              attentions: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """Step 1: ``scorer``'s scores of ``keys``, ``(batch, kv_heads, seq_len)`` in float32; what a wrapper pulls
        (as kvpress's ``AdaKVPress`` pulls ``press.score``)."""
        return token_scores(self.scorer, module, hidden_states, keys, values, attentions, kwargs)

    def compress(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor,
        kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1 to 4 of the module docstring, with kvpress's arguments."""
        self.validate()
        layer_idx = getattr(module, "layer_idx", 0)
        seq_len = keys.shape[2]
        _check_positions(self, hidden_states, seq_len)
        shape = dict(batch=keys.shape[0], heads=keys.shape[1],  # recorded for cache_summary's bytes
                     entry_bytes=keys.shape[-1] * keys.element_size() + values.shape[-1] * values.element_size())
        if self.compression_ratio == 0:
            self.stats[layer_idx] = LayerStats(seq_len, seq_len, 0.0, None, None, requested_ratio=0.0,
                                               window_ratio=0.0, **shape)
            return keys, values

        def score():
            return self.score(module, hidden_states, keys, values, attentions, kwargs)

        scores = score() if self.needs_scores_for_grid else None                      # 1. score (for the grid)
        layout = self.layout_for(module, keys, scores)                                # 2. lay out
        if layout.n_windows == 0:  # too short for one window: nothing to score or compress
            self.stats[layer_idx] = LayerStats(seq_len, seq_len, 0.0, layout, None,
                                               requested_ratio=self.compression_ratio, window_ratio=0.0, **shape)
            return keys, values
        if scores is None and self.needs_scores:
            scores = score()                                                          # 1. score
        out = self.compress_windows(module, keys, values, scores, layout)             # 3. choose or merge
        ends = out.ends if out.ends is not None else self.entry_ends(layout, out.positions)
        stored = out.keys.shape[2]  # layout.compressed_length unless the budget differs between layers or heads
        masked, attended = None, stored
        if out.masked is not None:  # padding of heads with smaller budgets: kvpress masks it while decoding
            batch_idx, head_idx, seq_idx = torch.nonzero(out.masked, as_tuple=True)
            module.masked_key_indices = (batch_idx, head_idx, seq_idx)
            masked = (head_idx, seq_idx)
            attended = stored - out.masked.sum(dim=-1).float().mean().item()
        self.stats[layer_idx] = LayerStats(                                           # 4. record
            seq_len, stored, 1.0 - attended / seq_len, layout, out.positions.to(torch.int32),
            ends.to(torch.int32), requested_ratio=self.compression_ratio, window_ratio=self.window_ratio,
            masked=masked, **shape,
        )
        return out.keys, out.values

    def grid_offsets(
        self, module: nn.Module, scores: Optional[torch.Tensor], batch: int, heads: int, seq_len: int
    ) -> Union[int, torch.Tensor]:
        """Offset of each row's window grid: one int, or a tensor broadcastable to ``(batch, heads)``."""
        return self.offset

    def layout_for(self, module: nn.Module, keys: torch.Tensor, scores: Optional[torch.Tensor] = None) -> WindowLayout:
        """The window layout this press uses for ``keys`` (``(batch, heads, seq_len, head_dim)``) in ``module``."""
        batch, heads, seq_len, _ = keys.shape
        return WindowLayout.build(seq_len, window=self.effective_window, stride=self.stride, k=self.k,
                                  offsets=self.grid_offsets(module, scores, batch, heads, seq_len),
                                  n_sink=self.n_sink, n_local=self.n_local, batch=batch, heads=heads,
                                  device=keys.device)

    def compress_windows(self, module: nn.Module, keys: torch.Tensor, values: torch.Tensor,
                         scores: Optional[torch.Tensor], layout: WindowLayout) -> Compressed:
        """Step 3: the entries that the windows of ``layout`` yield (each press defines it)."""
        raise NotImplementedError

    def entry_ends(self, layout: WindowLayout, positions: torch.Tensor) -> torch.Tensor:
        """One past the last source position of every entry, for kernels that return only start positions: a
        selected or raw token covers one position."""
        return positions + 1


# ------------------------------------------------------------------------------------------------ step 3 helpers
def fixed_windows(press, module: nn.Module, keys: torch.Tensor, values: torch.Tensor,
                  scores: Optional[torch.Tensor], layout: WindowLayout) -> Compressed:
    """Every window of ``layout`` becomes the same ``k`` slots: its ``k`` best tokens by score
    (``press.mode == "select"``), or ``k`` entries merged from its slots (``"pool"``, weighted by
    ``press.weighting``, keys re-rotated by ``press.rope``). One call into the kernels (:mod:`kvpress_phase.kernels`
    picks Triton or PyTorch)."""
    if press.mode == "select":
        return select_windows(keys, values, scores, layout, backend=press.backend)
    inv_freq = rotary_inv_freq(module) if press.needs_rope else None
    return pool_windows(keys, values, layout, scores=scores, weighting=press.weighting, rope=press.rope,
                        inv_freq=inv_freq, backend=press.backend)


def pooled_entry_ends(layout: WindowLayout, positions: torch.Tensor) -> torch.Tensor:
    """``entry_ends`` for windows pooled into ``k`` groups: a pooled entry covers its group of slots."""
    lo, hi = group_bounds(layout.window, layout.stride, layout.k)
    size = torch.tensor([h - l for l, h in zip(lo, hi)], device=positions.device)
    entry = (torch.arange(layout.compressed_length, device=positions.device) - layout.first[..., None])
    entry_size = size[entry.clamp(min=0) % layout.k]
    return torch.where(layout.window_slot_mask(), (positions + entry_size).clamp(max=layout.seq_len), positions + 1)


def check_window_options(mode: str, weighting: str, rope: str) -> None:
    check_choice("mode", mode, MODES)
    check_choice("weighting", weighting, WEIGHTINGS)
    check_choice("rope", rope, ROPE_MODES)


# ------------------------------------------------------------------------------------------------ checks
def unsupported_model(model, who: str) -> Optional[str]:
    """Why ``who`` (a press's class name, or what runs presses on ``model``) cannot run on ``model``, in one line;
    None when it can. kvpress (and :func:`_compress_after_prefill`, and the evaluation's recorded prefill) find the
    attention layers at ``model.model.layers[i].self_attn`` and hand each the model's ``model.model.rotary_emb``,
    which only its rotary decoders have (GPT-2, for one, has neither). The embedding may be None where nothing
    un-rotates keys (selection, or ``rope="none"``)."""
    inner = getattr(model, "model", None)
    inner = getattr(inner, "language_model", inner)
    layers = getattr(inner, "layers", None)
    missing = [path for path, ok in (
        ("model.model.rotary_emb", hasattr(inner, "rotary_emb")),
        ("model.model.layers[i].self_attn", layers is not None and all(hasattr(m, "self_attn") for m in layers)),
    ) if not ok]
    if not missing:
        return None
    return (f"{who} needs a model with rotary position embeddings whose attention layers kvpress can hook, as in "
            "Llama, Mistral, Qwen2/3, Phi3 and Gemma3 (model.model.rotary_emb and model.model.layers[i].self_attn); "
            f"{type(model).__name__} has no {' and no '.join(missing)}")


def _check_model(press, model) -> None:
    """Refuse, when the press is attached, a model whose attention layers kvpress cannot hook
    (:func:`unsupported_model`)."""
    message = unsupported_model(model, type(press).__name__)
    if message:
        raise ValueError(message)


def _check_positions(press, hidden_states: Optional[torch.Tensor], seq_len: int) -> None:
    """Refuse a cache that another press has already shortened: its indices are no longer token positions."""
    if hidden_states is None or hidden_states.dim() != 3 or seq_len >= hidden_states.shape[1]:
        return
    name = type(press).__name__
    raise ValueError(
        f"{name} received {seq_len} keys for {hidden_states.shape[1]} tokens: another press has already "
        f"shortened this layer's cache, so a key's index is no longer its position and {name}'s windows, phases "
        f"and RoPE re-rotation would be wrong. Put {name} first: ComposedPress([{name}(...), other_press]) "
        "works, the other press then prunes the compressed cache."
    )


@contextlib.contextmanager
def compressing(press, model, *, stores_ragged: bool = False):
    """The context a press of this package compresses a prefill in: kvpress's hooks (``press.forward_hook`` on every
    attention layer), or, with a scorer that needs the whole context (``press.scorer.needs_context``), compression
    once the prefill has finished (:func:`_compress_after_prefill`); inside
    :func:`~kvpress_phase.presses.storage.decoding_attention` (``stores_ragged``: the press stores KV heads at their
    own lengths), so that a cache plain SDPA cannot read is decoded with the package's attention."""
    with decoding_attention(press, model, stores_ragged=stores_ragged):
        if not getattr(press.scorer, "needs_context", False):
            with BasePress.__call__(press, model):
                yield
        else:
            with _compress_after_prefill(press, model):
                yield


@contextlib.contextmanager
def _compress_after_prefill(press, model):
    """Record each attention layer's prefill inputs (its RoPE and positions, not its hidden states) and the language
    model's input ids and cache (forward hooks), let the prefill finish uncompressed, have the press's scorer score
    the whole context (``scorer.compute(model, context_ids, cache)``), then compress every layer's cache, in layer
    order: ``press.compress_cached(module, None, cache, None, kwargs)`` where the press stores its layers itself
    (the budget wrappers), ``press.compress`` otherwise."""
    from transformers import QuantizedCache

    press.post_init_from_model(model)
    language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
    records: dict = {}
    seen: dict = {}

    def record_layer(module, args, kwargs, output):
        if is_prefilling(kwargs["cache_position"], kwargs["hidden_states"].shape[1]):
            kept = ("position_embeddings", "cache_position", "position_ids")
            records[module.layer_idx] = (module, {k: v for k, v in kwargs.items() if k in kept})

    def record_inputs(module, args, kwargs):
        seen["ids"] = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        seen["cache"] = kwargs.get("past_key_values")

    hooks = [language_model.register_forward_pre_hook(record_inputs, with_kwargs=True)]
    try:
        for layer in language_model.layers:
            layer.self_attn.rotary_emb = language_model.rotary_emb
            hooks.append(layer.self_attn.register_forward_hook(record_layer, with_kwargs=True))
        yield
    finally:
        for hook in hooks:
            hook.remove()
    cache, ids = seen.get("cache"), seen.get("ids")
    if not records or cache is None:
        return
    why = type(press.scorer).__name__
    if isinstance(cache, QuantizedCache):
        raise ValueError(f"{why} compresses after the prefill, which a QuantizedCache does not support here; use a "
                         "DynamicCache")
    if ids.shape[0] != 1:
        raise ValueError(f"{why} compresses one context at a time (batch 1), got {ids.shape[0]}")
    press.scorer.compute(model, ids, cache)
    for layer_idx, (module, kwargs) in sorted(records.items()):
        if hasattr(press, "compress_cached"):
            press.compress_cached(module, None, cache, None, kwargs)
            continue
        layer = cache.layers[layer_idx]
        layer.keys, layer.values = press.compress(module, None, layer.keys, layer.values, None, kwargs)
