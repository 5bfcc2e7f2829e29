"""Compression ops of kvpress-phase, with one dispatch point between Triton and PyTorch.

Public functions: :func:`select_windows`, :func:`pool_windows`, :func:`keep_and_pool` and :func:`ragged_attention`
(attention over a ragged, head-flattened KV cache: :mod:`.naive_ragged`, :mod:`.triton_varlen_decode`). Each runs the Triton kernel when the tensors
are on a CUDA device and Triton is importable, and the plain-PyTorch reference (:mod:`.naive`, the
specification) otherwise. Force either with ``backend="triton"`` / ``backend="torch"`` or the environment
variable ``KVPRESS_PHASE_BACKEND`` (``auto``, ``triton`` or ``torch``; the argument wins). With
``TRITON_INTERPRET=1`` a forced Triton backend also runs on CPU tensors (slowly), which is how the parity tests
run without a GPU.

Inputs a kernel does not support (:func:`.triton_common.unsupported` says why) fall back to the reference with a
one-time warning under ``auto``, and raise ``ValueError`` when Triton was forced. Presses call these functions and
never branch on device themselves; this module is the only one that chooses between the backends.

Modules: :mod:`.naive` and :mod:`.naive_ragged` (the references), :mod:`.triton_select`, :mod:`.triton_pool`,
:mod:`.triton_keep_and_pool` (one fused kernel each), :mod:`.triton_common` (what those three share) and
:mod:`.triton_varlen_decode` (flash-decoding over heads of different lengths).

Only torch (and, when present, triton) is imported, with the torch-only :mod:`kvpress_phase.core`: this package
works without kvpress or transformers, and imports nothing from the presses or the package root.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Optional

import torch

from kvpress_phase.core.phase import WindowLayout

from . import naive, naive_ragged
from .naive import ROPE_MODES, WEIGHTINGS, Compressed

__all__ = ["select_windows", "pool_windows", "keep_and_pool", "ragged_attention", "Compressed", "resolve_backend",
           "triton_available", "BACKENDS", "ROPE_MODES", "WEIGHTINGS"]

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "KVPRESS_PHASE_BACKEND"


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether Triton and this package's kernels import on this machine."""
    try:
        from . import triton_keep_and_pool, triton_pool, triton_select, triton_varlen_decode  # noqa: F401
    except Exception:  # ImportError on macOS/Windows, or a broken Triton install
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(tensor: torch.Tensor, backend: Optional[str] = None) -> str:
    """``"triton"`` or ``"torch"``: the backend an op on ``tensor`` runs with."""
    choice = (backend or os.environ.get(ENV_VAR) or "auto").lower()
    if choice not in BACKENDS:
        source = "backend" if backend else ENV_VAR
        raise ValueError(f"{source} must be one of {BACKENDS}, got {choice!r}")
    if choice == "torch":
        return "torch"
    on_device = tensor.is_cuda or (_interpreting() and tensor.device.type == "cpu")
    if choice == "triton":
        if not triton_available():
            raise ValueError("backend='triton' was forced but Triton (or its kernels) cannot be imported here")
        if not on_device:
            raise ValueError(
                f"backend='triton' was forced but the tensors are on {tensor.device}; Triton needs a CUDA device "
                "(or TRITON_INTERPRET=1 for CPU tensors)"
            )
        return "triton"
    return "triton" if tensor.is_cuda and triton_available() else "torch"


_warned: set[str] = set()


def _fallback(reason: str, forced: bool) -> None:
    if forced:
        raise ValueError(f"backend='triton' was forced but the kernel does not support this input: {reason}")
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"kvpress_phase.kernels: using the PyTorch reference: {reason}", stacklevel=3)


def _forced(backend: Optional[str]) -> bool:
    return (backend or os.environ.get(ENV_VAR) or "auto").lower() == "triton"


def select_windows(
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    layout: WindowLayout,
    *,
    backend: Optional[str] = None,
) -> Compressed:
    """Keep the ``k`` best tokens of every window. See :func:`.naive.select_windows` for the exact semantics."""
    if resolve_backend(keys, backend) == "triton":
        from . import triton_common, triton_select

        reason = triton_common.unsupported(keys, values, layout, mode="select", scores=scores)
        if reason is None:
            return triton_select.select_windows(keys, values, scores, layout)
        _fallback(reason, _forced(backend))
    return naive.select_windows(keys, values, scores, layout)


def pool_windows(
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: WindowLayout,
    *,
    scores: Optional[torch.Tensor] = None,
    weighting: str = "mean",
    rope: str = "none",
    inv_freq: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> Compressed:
    """Merge every window into ``k`` entries. See :func:`.naive.pool_windows` for the exact semantics."""
    if resolve_backend(keys, backend) == "triton":
        from . import triton_common, triton_pool

        reason = triton_common.unsupported(
            keys, values, layout, mode="pool", rope=rope, inv_freq=inv_freq,
            scores=scores if weighting == "score" else None,
        )
        if reason is None:
            return triton_pool.pool_windows(
                keys, values, layout, scores=scores, weighting=weighting, rope=rope, inv_freq=inv_freq
            )
        _fallback(reason, _forced(backend))
    return naive.pool_windows(keys, values, layout, scores=scores, weighting=weighting, rope=rope, inv_freq=inv_freq)


def keep_and_pool(
    keys: torch.Tensor,
    values: torch.Tensor,
    raw: torch.Tensor,
    layout: WindowLayout,
    *,
    scores: Optional[torch.Tensor] = None,
    weighting: str = "mean",
    rope: str = "none",
    inv_freq: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> Compressed:
    """Keep the tokens ``raw`` marks and merge each window's others into one entry. See
    :func:`.naive.keep_and_pool` for the exact semantics."""
    if resolve_backend(keys, backend) == "triton":
        from . import triton_common, triton_keep_and_pool

        reason = triton_common.unsupported(
            keys, values, layout, mode="keep_and_pool", rope=rope, inv_freq=inv_freq,
            scores=scores if weighting == "score" else None, raw=raw,
        )
        if reason is None:
            return triton_keep_and_pool.keep_and_pool(
                keys, values, raw, layout, scores=scores, weighting=weighting, rope=rope, inv_freq=inv_freq
            )
        _fallback(reason, _forced(backend))
    return naive.keep_and_pool(keys, values, raw, layout, scores=scores, weighting=weighting, rope=rope,
                               inv_freq=inv_freq)


def ragged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scaling: Optional[float] = None,
    backend: Optional[str] = None,
    check_index: bool = True,
) -> torch.Tensor:
    """Attention of ``query`` (``(q_heads, n_new, head_dim)``) over each KV head's own entries of head-flattened
    ``keys``/``values`` (``(capacity, dim)``; head ``h`` owns rows ``starts[h] .. starts[h] + lengths[h] - 1``), causal
    within the ``n_new`` newest entries. See :func:`.naive_ragged.ragged_attention` for the exact semantics;
    ``check_index=False`` (a cache that keeps its index valid) skips reading the index to check it."""
    naive_ragged.check_ragged_arguments(query, keys, values, starts, lengths, check_index=check_index)
    if resolve_backend(query, backend) == "triton":
        from . import triton_varlen_decode

        reason = triton_varlen_decode.unsupported(query, keys, values, starts.shape[0])
        if reason is None:
            return triton_varlen_decode.ragged_attention(query, keys, values, starts, lengths, scaling=scaling)
        _fallback(reason, _forced(backend))
    return naive_ragged.ragged_attention(query, keys, values, starts, lengths, scaling=scaling, check_index=False)
