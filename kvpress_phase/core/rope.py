"""RoPE handling: the one place that knows how keys are rotated.

Keys reach a press already rotated at their absolute positions. transformers rotates with the "rotate half"
layout: for a rotary dimension ``r = 2 * len(inv_freq)`` (``r <= head_dim``; partial rotary leaves the rest of
the head untouched), the pair ``(x[i], x[i + r/2])`` is rotated by the angle ``position * inv_freq[i]``.
Rotations compose, so moving a key from position ``p`` to position ``q`` is a rotation by ``q - p``; un-rotating
is a rotation by ``-p``. Attention scaling factors (YaRN, LongRoPE) multiply every key the same way and are
preserved by these rotations.

Only torch is imported here, so the kernels' references can use it without kvpress or transformers. The public
path is :mod:`kvpress_phase.core.rope`, which re-exports it.
"""

from __future__ import annotations

import torch
from torch import nn


def rotary_inv_freq(module: nn.Module) -> torch.Tensor:
    """The inverse frequencies of the rotary embedding that ``module`` (an attention layer) uses.

    kvpress attaches the model's rotary embedding to every attention layer as ``module.rotary_emb`` when a press
    is applied. Models whose rotary embedding keeps one set of frequencies per layer type (Gemma3) are resolved
    through ``module.config.layer_types``.

    Raises
    ------
    ValueError
        If the module has no rotary embedding (the message names the module's class).
    """
    rotary = getattr(module, "rotary_emb", None)
    if rotary is None:
        raise ValueError(
            f"{type(module).__name__} has no rotary embedding (module.rotary_emb): RoPE-aware pooling "
            "(rope='start', 'center' or 'centroid') needs one. Apply the press with `with press(model):` or the "
            "kvpress pipeline, or use rope='none'."
        )
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None:
        layer_types = getattr(getattr(module, "config", None), "layer_types", None)
        layer_idx = getattr(module, "layer_idx", None)
        if layer_types is not None and layer_idx is not None:
            inv_freq = getattr(rotary, f"{layer_types[layer_idx]}_inv_freq", None)
    if inv_freq is None:
        raise ValueError(
            f"{type(rotary).__name__} attached to {type(module).__name__} exposes no inverse frequencies "
            "(inv_freq); RoPE-aware pooling cannot un-rotate its keys. Use rope='none'."
        )
    head_dim = getattr(module, "head_dim", None)
    if head_dim is not None and 2 * inv_freq.numel() > head_dim:
        raise ValueError(
            f"{type(module).__name__}: rotary dimension {2 * inv_freq.numel()} exceeds head_dim {head_dim}"
        )
    return inv_freq


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``(..., head_dim)``) by the angles ``positions * inv_freq``.

    ``positions`` broadcasts against ``x.shape[:-1]`` and may be fractional or negative (a negative position
    un-rotates). The rotation is computed and returned in float32; only the first ``2 * len(inv_freq)``
    dimensions change. Angles are computed once per distinct entry of ``positions``, so a small table that
    broadcasts over a large ``x`` costs no more than the multiply-adds.
    """
    half = inv_freq.numel()
    angles = positions.to(device=x.device, dtype=torch.float32)[..., None] * inv_freq.to(x.device, torch.float32)
    cos, sin = angles.cos(), angles.sin()
    x = x.float()
    rest = x.shape[-1] - 2 * half
    # out = x * [cos, cos, 1] in one contiguous pass, then the cross terms added in place
    scale = torch.cat((cos, cos, cos.new_ones(cos.shape[:-1] + (rest,))), dim=-1)
    out = x * scale
    out[..., :half].addcmul_(x[..., half : 2 * half], sin, value=-1)
    out[..., half : 2 * half].addcmul_(x[..., :half], sin)
    return out


def add_rotated_(out: torch.Tensor, x: torch.Tensor, position: float, inv_freq: torch.Tensor,
                 weight: torch.Tensor | None = None) -> torch.Tensor:
    """``out += weight * rotate(x, position, inv_freq)`` in place, for one scalar ``position``, without a
    temporary the size of ``x``. ``out`` is float32 and has ``x``'s shape; ``weight`` (optional) broadcasts
    against ``x.shape[:-1] + (1,)``. Returns ``out``."""
    half = inv_freq.numel()
    angles = float(position) * inv_freq.to(out.device, torch.float32)
    cos, sin = angles.cos(), angles.sin()
    if weight is not None:
        cos, sin = weight * cos, weight * sin
    x = x.float()
    lo, hi = x[..., :half], x[..., half : 2 * half]
    out[..., :half].addcmul_(lo, cos).addcmul_(hi, sin, value=-1)
    out[..., half : 2 * half].addcmul_(hi, cos).addcmul_(lo, sin)
    if x.shape[-1] > 2 * half:
        rest = x[..., 2 * half :]
        out[..., 2 * half :].add_(rest) if weight is None else out[..., 2 * half :].addcmul_(rest, weight)
    return out
