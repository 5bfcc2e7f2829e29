"""Fused Triton kernel for selection: keep the ``k`` best tokens of every window (``window == stride``).

Triton version of :func:`.naive.select_windows`, bit for bit. A program loads the scores of its windows as a
``(BNW, S)`` tile, ranks every slot against the whole window in chunks of ``BI`` slots
(``rank_i = #{j : s_j > s_i or (s_j == s_i and j < i)}``, NaN above everything, as the stable descending sort
of the reference), keeps ``rank < k``, numbers the kept slots in order with a prefix sum, and gathers only the
kept rows of keys and values into their output slots. The grid and the raw-token programs are those of every
kernel here (:mod:`.triton_common`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpress_phase.core.phase import WindowLayout

from .naive import Compressed
from .triton_common import (SIZE_ARGS, copy_raw_tokens, copy_window_slots, head_dims, outputs, passthrough, pow2,
                            profile, raw_block, require, row_offsets, window_block)

__all__ = ["select_windows"]


@triton.jit(do_not_specialize=SIZE_ARGS)
def _select_kernel(
    K, V, SC, FIRST, OK, OV, OP,
    H, n, cl, nw, S, KSEL, n_raw, n_wblk,
    skb, skh, sks, skd, svb, svh, svs, svd, ssb, ssh, sss,
    DK, DV,
    BNW: tl.constexpr, BI: tl.constexpr, BS: tl.constexpr,
    BDK: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr,
):
    pid_blk = tl.program_id(0)
    row, kbase, vbase, sbase, okbase, ovbase, opbase = row_offsets(H, cl, skb, skh, svb, svh, ssb, ssh, DK, DV)
    first = tl.load(FIRST + row).to(tl.int32)
    dk, dv, dkm, dvm = head_dims(DK, DV, BDK, BDV)

    if pid_blk < n_wblk:
        w, wm, start = window_block(pid_blk, first, nw, S, BNW)  # (BNW,)
        j = tl.arange(0, BS)
        jm = j < S
        s_all = tl.load(
            SC + sbase + (start[:, None] + j[None, :]).to(tl.int64) * sss, mask=wm[:, None] & jm[None, :], other=0.0
        ).to(tl.float32)
        nan_all = s_all != s_all
        count = tl.zeros([BNW], dtype=tl.int32)  # slots kept so far in each window
        for i0 in range(0, S, BI):
            i = i0 + tl.arange(0, BI)
            im = i < S
            src = start[:, None] + i[None, :]  # (BNW, BI)
            s_i = tl.load(SC + sbase + src.to(tl.int64) * sss, mask=wm[:, None] & im[None, :], other=0.0)
            s_i = s_i.to(tl.float32)
            nan_i = (s_i != s_i)[:, :, None]
            sj = s_all[:, None, :]
            si = s_i[:, :, None]
            nj = nan_all[:, None, :]
            greater = (sj > si) | (nj & (nan_i == 0))
            equal = (sj == si) | (nj & nan_i)
            earlier = j[None, None, :] < i[None, :, None]
            better = (greater | (equal & earlier)) & jm[None, None, :]
            rank = tl.sum(better.to(tl.int32), axis=2)  # (BNW, BI)
            keep = (rank < KSEL) & im[None, :] & wm[:, None]
            keep_i = keep.to(tl.int32)
            slot = count[:, None] + tl.cumsum(keep_i, axis=1) - keep_i
            count += tl.sum(keep_i, axis=1)
            dst = (first + w[:, None] * KSEL + slot).to(tl.int64)  # (BNW, BI)
            copy_window_slots(K, V, OK, OV, OP, kbase, vbase, okbase, ovbase, opbase, src.to(tl.int64), dst, keep,
                              sks, skd, svs, svd, DK, DV, dk, dv, dkm, dvm)
    else:
        r = (pid_blk - n_wblk) * BT + tl.arange(0, BT)
        rm = r < n_raw
        src = tl.where(r < first, r, r + nw * S).to(tl.int64)
        dst = tl.where(r < first, r, r + nw * KSEL).to(tl.int64)
        copy_raw_tokens(K, V, OK, OV, OP, kbase, vbase, okbase, ovbase, opbase, src, dst, rm,
                        sks, skd, svs, svd, DK, DV, dk, dv, dkm, dvm)


def select_windows(
    keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, layout: WindowLayout
) -> Compressed:
    """Triton version of :func:`.naive.select_windows` (same arguments, same result)."""
    if layout.window != layout.stride:
        raise ValueError(f"select needs window == stride, got window={layout.window}, stride={layout.stride}")
    if scores is None:
        raise ValueError("select needs scores")
    require(keys, values, layout, mode="select", scores=scores)
    if layout.n_windows == 0:
        return passthrough(keys, values)
    b, h, n, dkk = keys.shape
    dvv = values.shape[-1]
    S, k, nw = layout.stride, layout.k, layout.n_windows
    out_k, out_v, out_p, first = outputs(keys, values, layout)
    tiles = profile()
    bdk, bdv = max(16, pow2(dkk)), max(16, pow2(dvv))
    bs = pow2(S)
    if tiles == "interpreter":  # few large programs: the interpreter pays per program, not per element
        bi = bs
        bnw = min(pow2(nw), 32)
    elif tiles == "tiny":
        bi, bnw = min(bs, 2), 2
    else:  # (BNW, BI, head_dim) gather tile <= 2K elements, (BNW, BI, S) ranking tile <= 4K (about 120 registers)
        bi = min(bs, 16, max(1, 4096 // bs))
        bnw = max(1, min(32, 2048 // (bi * max(bdk, bdv)), 4096 // (bi * bs)))
    n_raw = n - nw * S
    bt = raw_block(n_raw, max(bdk, bdv), tiles)
    n_wblk = triton.cdiv(nw, bnw)
    grid = (n_wblk + triton.cdiv(n_raw, bt), b * h)
    _select_kernel[grid](
        keys, values, scores, first, out_k, out_v, out_p,
        h, n, layout.compressed_length, nw, S, k, n_raw, n_wblk,
        *keys.stride(), *values.stride(), *scores.stride(),
        dkk, dvv,
        BNW=bnw, BI=bi, BS=bs, BDK=bdk, BDV=bdv, BT=bt,
        num_warps=4,
    )
    return Compressed(out_k, out_v, out_p)
