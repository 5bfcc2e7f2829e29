"""Fused Triton kernel for pooling: merge every window into ``k`` entries, optionally RoPE-aware.

Triton version of :func:`.naive.pool_windows`, within floating-point tolerance. For each of the ``k`` groups
(bounds from :func:`~kvpress_phase.core.phase.group_bounds`), a program walks the group's slots in chunks of ``BL``
(two extra passes over the scores for the softmax when weighting by score), turns the keys back to the window
start in float32 (angles ``(position - window_start) * inv_freq`` computed in the kernel, as the reference does,
so precision does not degrade with position; the rotary halves and the untouched rest of a partial-rotary head
are separate tiles), accumulates the weighted sums of keys, values and (for ``rope="centroid"``) positions in
float32, turns the merged key on to its representative position, clamps to the output dtype's finite range and
stores. Slots past the end of the sequence read the last token, as in the reference.

The blocks this kernel shares with the keep-and-pool kernel (softmax passes, weighted sums, un-rotation and
re-rotation, clamped stores), the grid and the raw-token programs are in :mod:`.triton_common`.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from kvpress_phase.core.phase import WindowLayout, group_bounds

from .naive import Compressed, check_pool_arguments
from .triton_common import (SIZE_ARGS, copy_raw_tokens, head_dims, outputs, passthrough, pool_launch, require,
                            rotary_tiles, row_offsets, score_exp_sum, score_max, softmax_weights, store_clamped,
                            store_rotated, unrotate_and_sum, weighted_sum, window_block, zero_accumulators)

__all__ = ["pool_windows"]


@triton.jit(do_not_specialize=SIZE_ARGS)
def _pool_kernel(
    K, V, SC, FIRST, LO, HI, INVF, OK, OV, OP,
    H, n, cl, nw, S, KSEL, n_raw, n_wblk, HALF,
    skb, skh, sks, skd, svb, svh, svs, svd, ssb, ssh, sss,
    DK, DV,
    SCORE: tl.constexpr, ROPE: tl.constexpr, HAS_REST: tl.constexpr,
    KMAX: tl.constexpr, VMAX: tl.constexpr,
    BNW: tl.constexpr, BL: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
    BH: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr,
):
    pid_blk = tl.program_id(0)
    row, kbase, vbase, sbase, okbase, ovbase, opbase = row_offsets(H, cl, skb, skh, svb, svh, ssb, ssh, DK, DV)
    first = tl.load(FIRST + row).to(tl.int32)
    dk, dv, dkm, dvm = head_dims(DK, DV, BDK, BDV)

    if pid_blk < n_wblk:
        w, wm, start = window_block(pid_blk, first, nw, S, BNW)  # (BNW,)
        last = n - 1
        if ROPE != 0:
            dh, hm, freq, dr, rest_m = rotary_tiles(INVF, HALF, DK, BH, BR)
        for g in range(0, KSEL):
            glo = tl.load(LO + g)
            ghi = tl.load(HI + g)
            glen = ghi - glo
            gstart = start + glo  # (BNW,) unclamped
            gpos = tl.minimum(gstart, last)  # first position of the group (clamped like every slot)
            if SCORE:
                gmax = tl.full([BNW], float("-inf"), dtype=tl.float32)
                for c0 in range(0, glen, BL):
                    jj = c0 + tl.arange(0, BL)
                    m2 = wm[:, None] & (jj < glen)[None, :]
                    p = tl.minimum(gstart[:, None] + jj[None, :], last)
                    gmax = score_max(gmax, SC, sbase, p, sss, m2)
                gsum = tl.zeros([BNW], dtype=tl.float32)
                for c0 in range(0, glen, BL):
                    jj = c0 + tl.arange(0, BL)
                    m2 = wm[:, None] & (jj < glen)[None, :]
                    p = tl.minimum(gstart[:, None] + jj[None, :], last)
                    gsum = score_exp_sum(gsum, SC, sbase, p, sss, m2, gmax)
            acc_v, acc_k, acc_1, acc_2, acc_r, acc_p = zero_accumulators(BNW, BDK, BDV, BH, BR)
            for c0 in range(0, glen, BL):
                jj = c0 + tl.arange(0, BL)
                m2 = wm[:, None] & (jj < glen)[None, :]
                p = tl.minimum(gstart[:, None] + jj[None, :], last)  # (BNW, BL)
                p64 = p.to(tl.int64)
                if SCORE:
                    wt = softmax_weights(SC, sbase, p64, sss, m2, gmax, gsum)
                else:
                    wt = tl.where(m2, 1.0 / glen.to(tl.float32), 0.0)
                wt3 = wt[:, :, None]
                m3 = m2[:, :, None]
                krow = K + kbase + p64[:, :, None] * sks
                if ROPE == 0:
                    acc_k = weighted_sum(acc_k, krow + dk[None, None, :] * skd, m3 & dkm[None, None, :], wt3)
                else:
                    # un-rotating at p and re-rotating at rep is one rotation by rep - p, split at the window
                    # start: slots turn by -(p - start) here, merged entries by rep - start below
                    rel = (p - start[:, None]).to(tl.float32)
                    acc_1, acc_2 = unrotate_and_sum(acc_1, acc_2, krow, dh, hm, HALF, skd, m3, wt3, rel, freq)
                    if HAS_REST:
                        acc_r = weighted_sum(
                            acc_r, krow + (2 * HALF + dr)[None, None, :] * skd, m3 & rest_m[None, None, :], wt3
                        )
                    if ROPE == 3:
                        acc_p += tl.sum(wt * (p - gpos[:, None]).to(tl.float32), axis=1)
                acc_v = weighted_sum(
                    acc_v, V + vbase + p64[:, :, None] * svs + dv[None, None, :] * svd, m3 & dvm[None, None, :], wt3
                )

            dst = (first + w * KSEL + g).to(tl.int64)  # (BNW,)
            okrow = OK + okbase + dst[:, None] * DK
            if ROPE == 0:
                store_clamped(okrow + dk[None, :], acc_k, wm[:, None] & dkm[None, :], KMAX)
            else:
                # representative position, relative to the window start
                if ROPE == 1:
                    rep = (gpos - start).to(tl.float32)
                elif ROPE == 2:
                    gend = tl.minimum(start + ghi - 1, last)
                    rep = (gpos + gend - 2 * start).to(tl.float32) / 2.0
                else:
                    rep = (gpos - start).to(tl.float32) + acc_p
                store_rotated(okrow, acc_1, acc_2, acc_r, rep, freq, dh, hm, dr, rest_m, HALF, wm, KMAX, HAS_REST)
            store_clamped(OV + ovbase + dst[:, None] * DV + dv[None, :], acc_v, wm[:, None] & dvm[None, :], VMAX)
            tl.store(OP + opbase + dst, gpos.to(tl.int64), mask=wm)
    else:
        r = (pid_blk - n_wblk) * BT + tl.arange(0, BT)
        rm = r < n_raw
        src = tl.where(r < first, r, r + nw * S).to(tl.int64)
        dst = tl.where(r < first, r, r + nw * KSEL).to(tl.int64)
        copy_raw_tokens(K, V, OK, OV, OP, kbase, vbase, okbase, ovbase, opbase, src, dst, rm,
                        sks, skd, svs, svd, DK, DV, dk, dv, dkm, dvm)


@functools.lru_cache(maxsize=64)
def _group_tables(window: int, stride: int, k: int, device: torch.device):
    """Group bounds as int32 device tensors, built once per (window, stride, k, device): a host-to-device copy
    on every call would synchronise the stream."""
    lo, hi = group_bounds(window, stride, k)
    lo_t = torch.tensor(lo, dtype=torch.int32, device=device)
    hi_t = torch.tensor(hi, dtype=torch.int32, device=device)
    return lo_t, hi_t, max(h - l for l, h in zip(lo, hi))


def pool_windows(
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: WindowLayout,
    *,
    scores: Optional[torch.Tensor] = None,
    weighting: str = "mean",
    rope: str = "none",
    inv_freq: Optional[torch.Tensor] = None,
) -> Compressed:
    """Triton version of :func:`.naive.pool_windows` (same arguments, same result)."""
    check_pool_arguments(weighting, rope, scores, inv_freq)
    use_scores = weighting == "score"
    require(keys, values, layout, mode="pool", rope=rope, inv_freq=inv_freq, scores=scores if use_scores else None)
    if layout.n_windows == 0:
        return passthrough(keys, values)

    b, h, n, dkk = keys.shape
    dvv = values.shape[-1]
    W, S, k, nw = layout.window, layout.stride, layout.k, layout.n_windows
    out_k, out_v, out_p, first = outputs(keys, values, layout)
    lo_t, hi_t, gmax = _group_tables(W, S, k, keys.device)
    n_raw = n - nw * S
    sc, freq, half, n_wblk, n_blocks, meta = pool_launch(
        keys, values, scores, use_scores, rope, inv_freq, lo_t, gmax, nw, n_raw
    )
    _pool_kernel[(n_blocks, b * h)](
        keys, values, sc, first, lo_t, hi_t, freq, out_k, out_v, out_p,
        h, n, layout.compressed_length, nw, S, k, n_raw, n_wblk, half,
        *keys.stride(), *values.stride(), *sc.stride()[:3],
        dkk, dvv,
        **meta,
        num_warps=4,
    )
    return Compressed(out_k, out_v, out_p)
