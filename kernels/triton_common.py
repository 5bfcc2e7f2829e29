"""What the Triton kernels of the three compression ops share: limits, checks, tiles and ``@triton.jit`` helpers.

The ops live in :mod:`.triton_select`, :mod:`.triton_pool` and :mod:`.triton_keep_and_pool`; each fused kernel
reads every needed key and value once and writes the whole compressed cache (raw tokens, window entries and the
positions tensor) in a single launch, and returns exactly what :mod:`.naive` (the specification) returns,
within floating-point tolerance for pooling and bit for bit for selection.

Grid (all three kernels): ``(n_window_blocks + n_raw_blocks, batch * heads)``. Axis 1 picks the (batch, head)
row, so every row can have its own first window (``layout.first``). On axis 0, the first ``n_window_blocks``
programs each handle ``BNW`` consecutive windows of that row; the remaining programs copy ``BT`` of the row's raw
tokens (those before the first window and after the last one; the same number in every row) to their output
slots. Strided (non-contiguous) keys, values and scores are read through their strides; outputs are contiguous.

This module holds:

- device helpers (``@triton.jit``, inlined into the kernels): the row's offsets and head-dimension tiles, a
  program's block of windows, copies of raw tokens, and the blocks both pooling kernels run for every chunk of
  a window's slots: the score softmax's max and sum, the slot weights, weighted float32 sums of keys and values,
  un-rotating keys to the window start and re-rotating merged keys, and clamped stores in the output dtype;
- host helpers: :func:`unsupported` (why an input cannot run, the one check the dispatch in ``__init__`` asks),
  the tile profile (:data:`TILES`), output allocation, and the launch parameters both pooling ops share.

Import needs only torch and triton (and the torch-only :mod:`kvpress_phase.core.phase`). The kernels run on CUDA
tensors, and on CPU tensors when ``TRITON_INTERPRET=1`` was set before triton was first imported.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from kvpress_phase.core.phase import WindowLayout

from .naive import ROPE_MODES, Compressed

__all__ = ["unsupported", "MAX_HEAD_DIM", "MAX_SELECT_WINDOW", "DTYPES", "TILES"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCORE_DTYPES = DTYPES + (torch.float64,)
MAX_HEAD_DIM = 256
MAX_SELECT_WINDOW = 1024
_MAX_ROWS = 65535  # grid axis 1 limit
_INT32_MAX = 2**31 - 1
ROPE_CODE = {"none": 0, "start": 1, "center": 2, "centroid": 3}
SIZE_ARGS = ["n", "cl", "nw", "n_raw", "n_wblk"]
"""Size arguments of the kernels that Triton must not specialise on (a new value would compile a new kernel)."""


# ---------------------------------------------------------------------------------------------- device helpers
@triton.jit
def row_offsets(H, cl, skb, skh, svb, svh, ssb, ssh, DK, DV):
    """The (batch, head) row of this program (grid axis 1) and its base offsets: into keys, values and scores
    through their strides, and into the contiguous outputs (keys, values, positions) of ``cl`` entries a row."""
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    row = pid_bh.to(tl.int64)
    return row, b * skb + h * skh, b * svb + h * svh, b * ssb + h * ssh, row * cl * DK, row * cl * DV, row * cl


@triton.jit
def head_dims(DK, DV, BDK: tl.constexpr, BDV: tl.constexpr):
    """The key and value head-dimension tiles and their masks."""
    dk = tl.arange(0, BDK)
    dv = tl.arange(0, BDV)
    return dk, dv, dk < DK, dv < DV


@triton.jit
def window_block(pid_blk, first, nw, S, BNW: tl.constexpr):
    """The ``BNW`` windows of this program (axis-0 block ``pid_blk``): indices, mask (``w < nw``) and start
    positions (windows start every ``S`` tokens from the row's ``first``)."""
    w = pid_blk * BNW + tl.arange(0, BNW)
    wm = w < nw
    start = first + w * S
    return w, wm, start


@triton.jit
def copy_raw_tokens(K, V, OK, OV, OP, kbase, vbase, okbase, ovbase, opbase, src, dst, rm,
                    sks, skd, svs, svd, DK, DV, dk, dv, dkm, dvm):
    """Copy the raw tokens ``src`` (``(BT,)`` positions, where ``rm`` holds) to the output slots ``dst``: key and
    value rows unchanged, and their positions."""
    km = rm[:, None] & dkm[None, :]
    x = tl.load(K + kbase + src[:, None] * sks + dk[None, :] * skd, mask=km)
    tl.store(OK + okbase + dst[:, None] * DK + dk[None, :], x, mask=km)
    vm = rm[:, None] & dvm[None, :]
    y = tl.load(V + vbase + src[:, None] * svs + dv[None, :] * svd, mask=vm)
    tl.store(OV + ovbase + dst[:, None] * DV + dv[None, :], y, mask=vm)
    tl.store(OP + opbase + dst, src, mask=rm)


@triton.jit
def copy_window_slots(K, V, OK, OV, OP, kbase, vbase, okbase, ovbase, opbase, src, dst, keep,
                      sks, skd, svs, svd, DK, DV, dk, dv, dkm, dvm):
    """Copy the window slots ``keep`` marks (``src``: ``(BNW, BL)`` int64 positions) to the output slots ``dst``
    (same shape): key and value rows unchanged, and their positions."""
    km = keep[:, :, None] & dkm[None, None, :]
    x = tl.load(K + kbase + src[:, :, None] * sks + dk[None, None, :] * skd, mask=km)
    tl.store(OK + okbase + dst[:, :, None] * DK + dk[None, None, :], x, mask=km)
    vm = keep[:, :, None] & dvm[None, None, :]
    y = tl.load(V + vbase + src[:, :, None] * svs + dv[None, None, :] * svd, mask=vm)
    tl.store(OV + ovbase + dst[:, :, None] * DV + dv[None, None, :], y, mask=vm)
    tl.store(OP + opbase + dst, src, mask=keep)


@triton.jit
def rotary_tiles(INVF, HALF, DK, BH: tl.constexpr, BR: tl.constexpr):
    """The tile of one rotary half, its mask and the inverse frequencies (float32, ``(BH,)``), then the tile of
    the untouched rest of a partial-rotary head (``DK - 2 * HALF`` dimensions) and its mask."""
    dh = tl.arange(0, BH)
    hm = dh < HALF
    freq = tl.load(INVF + dh, mask=hm, other=0.0)
    dr = tl.arange(0, BR)
    return dh, hm, freq, dr, dr < DK - 2 * HALF


@triton.jit
def zero_accumulators(BNW: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BH: tl.constexpr,
                      BR: tl.constexpr):
    """Float32 zeros for a merged entry of each of ``BNW`` windows: values, keys (``rope="none"``), the two rotary
    halves and the rest (RoPE-aware), and the mean relative position (``rope="centroid"``). A kernel uses the
    ones its RoPE mode needs; the compiler drops the others."""
    acc_v = tl.zeros([BNW, BDV], dtype=tl.float32)
    acc_k = tl.zeros([BNW, BDK], dtype=tl.float32)
    acc_1 = tl.zeros([BNW, BH], dtype=tl.float32)
    acc_2 = tl.zeros([BNW, BH], dtype=tl.float32)
    acc_r = tl.zeros([BNW, BR], dtype=tl.float32)
    acc_p = tl.zeros([BNW], dtype=tl.float32)
    return acc_v, acc_k, acc_1, acc_2, acc_r, acc_p


@triton.jit
def score_max(gmax, SC, sbase, p, sss, m):
    """``gmax`` (``(BNW,)``) raised to the largest score at the positions ``p`` (``(BNW, BL)``) where ``m`` holds;
    NaN propagates. The softmax's first pass."""
    s = tl.load(SC + sbase + p.to(tl.int64) * sss, mask=m, other=float("-inf")).to(tl.float32)
    return tl.maximum(gmax, tl.max(s, axis=1), propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def score_exp_sum(gsum, SC, sbase, p, sss, m, gmax):
    """``gsum`` plus the sum of ``exp(score - gmax)`` over the positions ``p`` where ``m`` holds. The softmax's
    second pass."""
    s = tl.load(SC + sbase + p.to(tl.int64) * sss, mask=m, other=0.0).to(tl.float32)
    return gsum + tl.sum(tl.where(m, tl.exp(s - gmax[:, None]), 0.0), axis=1)


@triton.jit
def softmax_weights(SC, sbase, p64, sss, m, gmax, gsum):
    """The softmax weight of every position ``p64`` where ``m`` holds (0 elsewhere), from the two passes' max and
    sum."""
    s = tl.load(SC + sbase + p64 * sss, mask=m, other=0.0).to(tl.float32)
    return tl.where(m, tl.exp(s - gmax[:, None]) / gsum[:, None], 0.0)


@triton.jit
def weighted_sum(acc, ptrs, m, wt3):
    """``acc`` plus the float32 sum over slots (axis 1) of ``wt3 * x``, ``x`` loaded from ``ptrs``
    (``(BNW, BL, D)``) where ``m`` holds (0 elsewhere)."""
    x = tl.load(ptrs, mask=m, other=0.0)
    return acc + tl.sum(wt3 * x.to(tl.float32), axis=1)


@triton.jit
def unrotate_and_sum(acc_1, acc_2, krow, dh, hm, HALF, skd, m3, wt3, rel, freq):
    """Add the weighted rotary halves of the keys at ``krow`` (``(BNW, BL, 1)`` row pointers, where ``m3``
    holds), each turned back by the angle ``rel * inv_freq`` (``rel``: float32 offset of the slot from its window
    start), to ``acc_1`` and ``acc_2``. Angles relative to the window start keep the precision independent of
    the position."""
    mh = m3 & hm[None, None, :]
    x1 = tl.load(krow + dh[None, None, :] * skd, mask=mh, other=0.0).to(tl.float32)
    x2 = tl.load(krow + (dh + HALF)[None, None, :] * skd, mask=mh, other=0.0).to(tl.float32)
    ang = rel[:, :, None] * freq[None, None, :]
    cos = tl.cos(ang)
    sin = tl.sin(ang)
    # un-rotate: rotation by -angle
    acc_1 += tl.sum(wt3 * (x1 * cos + x2 * sin), axis=1)
    acc_2 += tl.sum(wt3 * (x2 * cos - x1 * sin), axis=1)
    return acc_1, acc_2


@triton.jit
def store_clamped(ptrs, x, mask, MAX: tl.constexpr):
    """Store the float32 ``x`` at ``ptrs`` in their element type, clamped to ``[-MAX, MAX]`` first when
    ``MAX > 0`` (the finite range of float16 and bfloat16 outputs; NaN propagates)."""
    if MAX > 0:
        x = tl.clamp(x, -MAX, MAX, propagate_nan=tl.PropagateNan.ALL)
    tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def store_rotated(okrow, acc_1, acc_2, acc_r, rep, freq, dh, hm, dr, rest_m, HALF, wm,
                  KMAX: tl.constexpr, HAS_REST: tl.constexpr):
    """Turn the merged keys (rotary halves ``acc_1``, ``acc_2``, relative to the window start) on by the angle
    ``rep * inv_freq`` (``rep``: the representative position relative to the window start, ``(BNW,)``) and store
    them, with the untouched rest ``acc_r`` of a partial-rotary head, at the output rows ``okrow``."""
    ang = rep[:, None] * freq[None, :]
    cos = tl.cos(ang)
    sin = tl.sin(ang)
    out_1 = acc_1 * cos - acc_2 * sin
    out_2 = acc_2 * cos + acc_1 * sin
    mh = wm[:, None] & hm[None, :]
    store_clamped(okrow + dh[None, :], out_1, mh, KMAX)
    store_clamped(okrow + (dh + HALF)[None, :], out_2, mh, KMAX)
    if HAS_REST:
        store_clamped(okrow + (2 * HALF + dr)[None, :], acc_r, wm[:, None] & rest_m[None, :], KMAX)


# ---------------------------------------------------------------------------------------------- host side
def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreter_ready() -> bool:
    """Whether the kernels and triton.language's own jitted helpers (sum, cumsum, ...) were built for the
    interpreter: that is decided when triton and the kernel modules are first imported, not at launch."""
    jit_function = triton.runtime.jit.JITFunction
    return not isinstance(row_offsets, jit_function) and not isinstance(tl.cumsum, jit_function)


TILES = "auto"
"""Tile sizes: ``"auto"`` (large tiles, few programs under the interpreter; register-friendly tiles on a GPU),
``"device"`` (the GPU tiles everywhere) or ``"tiny"`` (smallest tiles, so that small test shapes run every chunk
loop and many blocks per row)."""


def profile() -> str:
    if TILES not in ("auto", "device", "tiny"):
        raise ValueError(f"TILES must be 'auto', 'device' or 'tiny', got {TILES!r}")
    if TILES == "auto":
        return "interpreter" if interpreting() else "device"
    return TILES


def pow2(x: int) -> int:
    return triton.next_power_of_2(max(1, int(x)))


def _fmax(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max) if dtype in (torch.float16, torch.bfloat16) else 0.0


def unsupported(
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: WindowLayout,
    *,
    mode: str,
    rope: str = "none",
    inv_freq: Optional[torch.Tensor] = None,
    scores: Optional[torch.Tensor] = None,
    raw: Optional[torch.Tensor] = None,
) -> Optional[str]:
    """Why the kernels cannot run this input (a sentence), or ``None`` when they can."""
    if mode not in ("select", "pool", "keep_and_pool"):
        return f"unknown mode {mode!r}"
    if keys.dim() != 4 or values.dim() != 4:
        return f"keys and values must be 4-D (batch, heads, seq_len, head_dim), got {keys.dim()}-D and {values.dim()}-D"
    if keys.shape[:3] != values.shape[:3]:
        return f"keys {tuple(keys.shape)} and values {tuple(values.shape)} disagree on (batch, heads, seq_len)"
    if keys.device != values.device:
        return f"keys are on {keys.device} but values on {values.device}"
    if keys.device.type != "cuda" and not (keys.device.type == "cpu" and interpreting()):
        return f"the kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {keys.device}"
    if keys.device.type == "cpu" and not interpreter_ready():
        return "CPU tensors need the Triton interpreter, but triton was imported before TRITON_INTERPRET=1 was set"
    for name, t in (("keys", keys), ("values", values)):
        if t.dtype not in DTYPES:
            return f"{name} dtype {t.dtype} is not one of float32, float16, bfloat16"
        if not 1 <= t.shape[-1] <= MAX_HEAD_DIM:
            return f"{name} head_dim {t.shape[-1]} is outside [1, {MAX_HEAD_DIM}]"
    batch, heads, seq_len = keys.shape[:3]
    if batch * heads == 0:
        return "empty batch or no heads"
    if tuple(layout.first.shape) != (batch, heads) or layout.seq_len != seq_len:
        return (
            f"layout is for (batch, heads, seq_len) = ({layout.batch}, {layout.heads}, {layout.seq_len}) but the "
            f"tensors are ({batch}, {heads}, {seq_len})"
        )
    if layout.n_windows == 0:
        return None  # nothing to compress: the input passes through unchanged
    if batch * heads > _MAX_ROWS:
        return f"batch * heads = {batch * heads} exceeds {_MAX_ROWS} rows"
    if seq_len + layout.window + layout.stride >= _INT32_MAX:
        return f"seq_len {seq_len} is too long for 32-bit positions"
    if mode == "select":
        if layout.window != layout.stride:
            return f"select needs window == stride, got window={layout.window}, stride={layout.stride}"
        if layout.stride > MAX_SELECT_WINDOW:
            return f"select supports windows of at most {MAX_SELECT_WINDOW} tokens, got {layout.stride}"
    else:
        if rope not in ROPE_MODES:
            return f"rope must be one of {ROPE_MODES}, got {rope!r}"
        if rope != "none":
            if inv_freq is None:
                return f"rope={rope!r} needs inv_freq"
            if inv_freq.dim() != 1 or inv_freq.numel() == 0 or not inv_freq.is_floating_point():
                return f"inv_freq must be a non-empty 1-D float tensor, got shape {tuple(inv_freq.shape)}"
            if 2 * inv_freq.numel() > keys.shape[-1]:
                return f"rotary dimension {2 * inv_freq.numel()} exceeds the keys' head_dim {keys.shape[-1]}"
    if mode == "keep_and_pool":
        if layout.window != layout.stride:
            return f"keep_and_pool needs window == stride, got window={layout.window}, stride={layout.stride}"
        if raw is None or tuple(raw.shape) != (batch, heads, seq_len) or raw.device != keys.device:
            return f"raw must be a ({batch}, {heads}, {seq_len}) mask on {keys.device}"
    if scores is not None:
        if tuple(scores.shape) != (batch, heads, seq_len):
            return f"scores must have shape {(batch, heads, seq_len)}, got {tuple(scores.shape)}"
        if scores.dtype not in SCORE_DTYPES:
            return f"scores dtype {scores.dtype} is not a supported float type"
        if scores.device != keys.device:
            return f"scores are on {scores.device} but keys on {keys.device}"
    return None


def require(keys, values, layout, **kw) -> None:
    """``ValueError`` with :func:`unsupported`'s reason when the kernels cannot run this input."""
    reason = unsupported(keys, values, layout, **kw)
    if reason is not None:
        raise ValueError(f"the Triton kernel does not support this input: {reason}")


def passthrough(keys: torch.Tensor, values: torch.Tensor) -> Compressed:
    """The result for a layout without windows: the input, at positions ``0 .. seq_len - 1``."""
    b, h, n = keys.shape[:3]
    return Compressed(keys, values, torch.arange(n, device=keys.device).expand(b, h, n))


def outputs(keys, values, layout):
    """Empty compressed keys, values and positions of ``layout.compressed_length`` entries, and ``layout.first``
    as a contiguous long tensor on the keys' device."""
    b, h = keys.shape[:2]
    cl = layout.compressed_length
    out_k = torch.empty((b, h, cl, keys.shape[-1]), dtype=keys.dtype, device=keys.device)
    out_v = torch.empty((b, h, cl, values.shape[-1]), dtype=values.dtype, device=values.device)
    out_p = torch.empty((b, h, cl), dtype=torch.long, device=keys.device)
    first = layout.first.to(device=keys.device, dtype=torch.long).contiguous()
    return out_k, out_v, out_p, first


def raw_block(n_raw: int, bd: int, profile: str) -> int:
    """``BT``: raw tokens each of the raw-copy programs handles."""
    if profile == "interpreter":
        return min(pow2(n_raw), 256)
    if profile == "tiny":
        return 4
    return max(4, min(128, 2048 // bd))


def pool_launch(keys, values, scores, use_scores: bool, rope: str, inv_freq, placeholder: torch.Tensor,
                group_len: int, nw: int, n_raw: int):
    """What the pool and keep-and-pool launches share: ``(scores, inv_freq, half, n_wblk, n_blocks, meta)``.

    ``scores`` is the keys when unused and ``inv_freq`` is ``placeholder`` (an int32 tensor) when ``rope`` is
    ``"none"``: pointers the kernel never reads. ``half`` is the number of rotary pairs, ``n_wblk`` the number of
    window programs per row, ``n_blocks`` the size of grid axis 0, and ``meta`` the kernel's constexpr arguments
    (tiles sized for windows of at most ``group_len`` merged slots each).
    """
    dkk, dvv = keys.shape[-1], values.shape[-1]
    code = ROPE_CODE[rope]
    if code:
        freq = inv_freq.to(device=keys.device, dtype=torch.float32).contiguous()
        half = freq.numel()
    else:
        freq = placeholder  # placeholder pointer, never read
        half = 0
    bh_, br = max(16, pow2(half)), max(16, pow2(dkk - 2 * half))
    has_rest = bool(code) and dkk > 2 * half
    bdk, bdv = max(16, pow2(dkk)), max(16, pow2(dvv))
    sc = scores if use_scores else keys  # placeholder pointer when unused
    tiles = profile()
    if tiles == "interpreter":
        bl, bnw = min(pow2(group_len), 64), min(pow2(nw), 32)
    elif tiles == "tiny":
        bl, bnw = min(pow2(group_len), 2), 2
    else:  # float32 tiles of <= 1K elements (<= 256 per rotary half: cos/sin and both halves are live at once)
        bl = min(pow2(group_len), 16, max(1, 1024 // max(bdk, bdv)))
        if code:
            bl = min(bl, max(1, 256 // bh_), max(1, 256 // br) if has_rest else bl)
        limit = 1024 // (bl * max(bdk, bdv))
        if code:
            limit = min(limit, 256 // (bl * bh_), 256 // (bl * br) if has_rest else limit)
        bnw = max(1, min(32, limit))
    bt = raw_block(n_raw, max(bdk, bdv), tiles)
    n_wblk = triton.cdiv(nw, bnw)
    meta = dict(
        SCORE=use_scores, ROPE=code, HAS_REST=has_rest, KMAX=_fmax(keys.dtype), VMAX=_fmax(values.dtype),
        BNW=bnw, BL=bl, BDK=bdk, BDV=bdv, BH=bh_, BR=br, BT=bt,
    )
    return sc, freq, half, n_wblk, n_wblk + triton.cdiv(n_raw, bt), meta
