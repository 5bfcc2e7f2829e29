"""PerLayerWindowedPress: a compression ratio per layer for the windowed presses."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Union

import torch
from kvpress import BasePress
from torch import nn

from kvpress_phase.core.phase import check_ratio
from kvpress_phase.presses.base import WindowedPress
from kvpress_phase.presses.budget import is_budget
from kvpress_phase.presses.storage import decoding_attention


@dataclass
class PerLayerWindowedPress(BasePress):
    """Apply ``press`` with a compression ratio of its own on every layer.

    The counterpart of kvpress's ``PerLayerCompressionPress`` (which accepts only a ``ScorerPress``): while a layer
    is compressed, ``press.compression_ratio`` is that layer's ratio, so the layer keeps exactly
    ``compressed_length(n, stride, compression_ratios[layer], n_sink, n_local)`` entries (inside a
    :class:`~kvpress_phase.WindowedDecodingPress`, at every step of the generation too). Unlike kvpress's wrapper it does not need flash attention:
    kvpress masks or pads nothing here, every layer's cache simply has its own length.

    Parameters
    ----------
    press : ChunkedStridePress, PhaseAwarePress or StaggeredWindowPress
        The press to apply; its own ``compression_ratio`` is the ratio of the layers a mapping leaves out.
    compression_ratios : list of float, or mapping from layer index to float
        A list gives every layer's ratio (its length must be the model's number of layers); a mapping gives the
        ratio of the layers it names. Each ratio is in [0, 1); 0 leaves the layer uncompressed.
    """

    press: WindowedPress
    compression_ratios: Union[Sequence[float], Mapping[int, float]]

    def __post_init__(self):
        if is_budget(self.press):
            raise ValueError(f"PerLayerWindowedPress sets each layer's budget itself; {type(self.press).__name__} spreads "
                             "the budget by score: use one or the other")
        if not isinstance(self.press, WindowedPress):
            raise ValueError(
                f"press must be a ChunkedStridePress, PhaseAwarePress or StaggeredWindowPress, got {type(self.press).__name__}; for a "
                "kvpress ScorerPress use kvpress's PerLayerCompressionPress"
            )
        ratios = self.compression_ratios
        if isinstance(ratios, Mapping):
            for layer, r in ratios.items():
                if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                    raise ValueError(f"compression_ratios keys must be layer indices >= 0, got {layer!r}")
                check_ratio(r, f"compression_ratios[{layer}]")
        elif isinstance(ratios, Sequence) and not isinstance(ratios, str) and len(ratios) > 0:
            for layer, r in enumerate(ratios):
                check_ratio(r, f"compression_ratios[{layer}]")
        else:
            raise ValueError(
                f"compression_ratios must be a non-empty list of ratios or a mapping from layer index to ratio, "
                f"got {ratios!r}"
            )
        self.n_layers = len(ratios) if not isinstance(ratios, Mapping) else None

    # ------------------------------------------------------------------ ratios
    def ratio_for(self, layer_idx: int) -> float:
        """The compression ratio of layer ``layer_idx``."""
        ratios = self.compression_ratios
        if isinstance(ratios, Mapping):
            return ratios.get(layer_idx, self.press.compression_ratio)
        if not 0 <= layer_idx < len(ratios):
            raise ValueError(f"compression_ratios has {len(ratios)} entries but layer {layer_idx} was compressed")
        return ratios[layer_idx]

    @property
    def compression_ratio(self) -> float:
        """Mean of the layers' ratios (over the model's layers once it is known)."""
        n = self.n_layers
        if n is None:
            n = (max(self.compression_ratios) + 1) if self.compression_ratios else 1
        return sum(self.ratio_for(i) for i in range(n)) / n

    @compression_ratio.setter
    def compression_ratio(self, value):
        raise AttributeError(f"compression_ratio cannot be set on {type(self).__name__}; set compression_ratios")

    @property
    def stats(self) -> dict:
        return self.press.stats

    # ------------------------------------------------------------------ kvpress hooks
    def post_init_from_model(self, model):
        n_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        text_config = getattr(getattr(model, "config", None), "get_text_config", None)
        if n_layers is None and text_config is not None:
            n_layers = getattr(text_config(), "num_hidden_layers", None)
        if n_layers is not None:
            ratios = self.compression_ratios
            if isinstance(ratios, Mapping):
                bad = sorted(i for i in ratios if i >= n_layers)
                if bad:
                    raise ValueError(f"compression_ratios names layers {bad}, but the model has {n_layers} layers")
            elif len(ratios) != n_layers:
                raise ValueError(f"compression_ratios has {len(ratios)} entries, but the model has {n_layers} layers")
            self.n_layers = n_layers
        self.press.post_init_from_model(model)

    @contextlib.contextmanager
    def __call__(self, model):
        """kvpress's context manager; the cache it leaves has layers of different lengths, which the model then
        decodes with the package's attention while the cache is alive
        (:func:`~kvpress_phase.presses.storage.decoding_attention`)."""
        with decoding_attention(self, model), BasePress.__call__(self, model):
            yield

    def _with_ratio(self, layer_idx: int, call):
        original = self.press.compression_ratio
        self.press.compression_ratio = self.ratio_for(layer_idx)
        try:
            return call()
        finally:
            self.press.compression_ratio = original

    def compress(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 attentions: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        layer_idx = getattr(module, "layer_idx", 0)
        return self._with_ratio(
            layer_idx, lambda: self.press.compress(module, hidden_states, keys, values, attentions, kwargs))
