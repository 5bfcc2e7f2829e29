"""Fused Triton kernel for keep-and-pool: keep the tokens a mask marks, merge each window's others into one entry.

Triton version of :func:`.naive.keep_and_pool`, within floating-point tolerance (``window == stride``): the host
computes the plan from the mask, then one launch copies the raw tokens, merges every window's members and writes
positions and ends (see :func:`keep_and_pool`). A window program counts the members of its windows and, when
weighting by score, takes the softmax's max and sum over them; a second pass copies the raw slots to their output
indices and accumulates the members in float32, un-rotated to the window start (angles ``slot * inv_freq``).

The blocks this kernel shares with the pool kernel (softmax passes, weighted sums, un-rotation and re-rotation,
clamped stores), the grid and the raw-token programs are in :mod:`.triton_common`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvpress_phase.core.phase import WindowLayout

from .naive import Compressed, check_pool_arguments, keep_and_pool_plan
from .triton_common import (SIZE_ARGS, copy_raw_tokens, copy_window_slots, head_dims, pool_launch, require,
                            rotary_tiles, row_offsets, score_exp_sum, score_max, softmax_weights, store_clamped,
                            store_rotated, unrotate_and_sum, weighted_sum, window_block, zero_accumulators)

__all__ = ["keep_and_pool"]


@triton.jit(do_not_specialize=SIZE_ARGS + ["kept"])
def _keep_pool_kernel(
    K, V, SC, RAW, OUTI, FIRST, MAT, FM, LM, INVF, OK, OV, OP, OE,
    H, n, cl, nw, G, n_raw, n_wblk, kept, HALF,
    skb, skh, sks, skd, svb, svh, svs, svd, ssb, ssh, sss,
    DK, DV,
    SCORE: tl.constexpr, ROPE: tl.constexpr, HAS_REST: tl.constexpr,
    KMAX: tl.constexpr, VMAX: tl.constexpr,
    BNW: tl.constexpr, BL: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
    BH: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr,
):
    pid_blk = tl.program_id(0)
    row, kbase, vbase, sbase, okbase, ovbase, opbase = row_offsets(H, cl, skb, skh, svb, svh, ssb, ssh, DK, DV)
    rbase = row * n
    first = tl.load(FIRST + row).to(tl.int32)
    dk, dv, dkm, dvm = head_dims(DK, DV, BDK, BDV)

    if pid_blk < n_wblk:
        w, wm, start = window_block(pid_blk, first, nw, G, BNW)  # (BNW,)
        wrow = row * nw + w
        fm = tl.load(FM + wrow, mask=wm, other=0)
        lm = tl.load(LM + wrow, mask=wm, other=0)
        mat = tl.load(MAT + wrow, mask=wm, other=0).to(tl.int64)
        if ROPE != 0:
            dh, hm, freq, dr, rest_m = rotary_tiles(INVF, HALF, DK, BH, BR)
        # pass 1: number of members, and the score softmax's max and sum over them
        n_mem = tl.zeros([BNW], dtype=tl.float32)
        gmax = tl.full([BNW], float("-inf"), dtype=tl.float32)
        for c0 in range(0, G, BL):
            jj = c0 + tl.arange(0, BL)
            m2 = wm[:, None] & (jj < G)[None, :]
            p = start[:, None] + jj[None, :]
            r = tl.load(RAW + rbase + p.to(tl.int64), mask=m2, other=1)
            mem = m2 & (r == 0)
            n_mem += tl.sum(mem.to(tl.float32), axis=1)
            if SCORE:
                gmax = score_max(gmax, SC, sbase, p, sss, mem)
        if SCORE:
            gsum = tl.zeros([BNW], dtype=tl.float32)
            for c0 in range(0, G, BL):
                jj = c0 + tl.arange(0, BL)
                m2 = wm[:, None] & (jj < G)[None, :]
                p = start[:, None] + jj[None, :]
                r = tl.load(RAW + rbase + p.to(tl.int64), mask=m2, other=1)
                mem = m2 & (r == 0)
                gsum = score_exp_sum(gsum, SC, sbase, p, sss, mem, gmax)
        # pass 2: copy the raw slots, accumulate the members
        acc_v, acc_k, acc_1, acc_2, acc_r, acc_p = zero_accumulators(BNW, BDK, BDV, BH, BR)
        for c0 in range(0, G, BL):
            jj = c0 + tl.arange(0, BL)
            m2 = wm[:, None] & (jj < G)[None, :]
            p = start[:, None] + jj[None, :]
            p64 = p.to(tl.int64)
            r = tl.load(RAW + rbase + p64, mask=m2, other=0)
            keep = m2 & (r != 0)
            mem = m2 & (r == 0)
            # raw slots go to their output index as they are
            dst = tl.load(OUTI + rbase + p64, mask=keep, other=0).to(tl.int64)
            copy_window_slots(K, V, OK, OV, OP, kbase, vbase, okbase, ovbase, opbase, p64, dst, keep,
                              sks, skd, svs, svd, DK, DV, dk, dv, dkm, dvm)
            tl.store(OE + opbase + dst, p64 + 1, mask=keep)
            # members are merged
            if SCORE:
                wt = softmax_weights(SC, sbase, p64, sss, mem, gmax, gsum)
            else:
                wt = tl.where(mem, 1.0 / tl.maximum(n_mem, 1.0)[:, None], 0.0)
            wt3 = wt[:, :, None]
            m3 = mem[:, :, None]
            krow = K + kbase + p64[:, :, None] * sks
            if ROPE == 0:
                acc_k = weighted_sum(acc_k, krow + dk[None, None, :] * skd, m3 & dkm[None, None, :], wt3)
            else:
                rel = jj.to(tl.float32)[None, :]  # slot = position - window start
                acc_1, acc_2 = unrotate_and_sum(acc_1, acc_2, krow, dh, hm, HALF, skd, m3, wt3, rel, freq)
                if HAS_REST:
                    acc_r = weighted_sum(
                        acc_r, krow + (2 * HALF + dr)[None, None, :] * skd, m3 & rest_m[None, None, :], wt3
                    )
                if ROPE == 3:
                    acc_p += tl.sum(wt * jj.to(tl.float32)[None, :], axis=1)
            acc_v = weighted_sum(
                acc_v, V + vbase + p64[:, :, None] * svs + dv[None, None, :] * svd, m3 & dvm[None, None, :], wt3
            )

        okrow = OK + okbase + mat[:, None] * DK
        if ROPE == 0:
            store_clamped(okrow + dk[None, :], acc_k, wm[:, None] & dkm[None, :], KMAX)
        else:
            # representative position, relative to the window start
            if ROPE == 1:
                rep = fm.to(tl.float32)
            elif ROPE == 2:
                rep = (fm + lm).to(tl.float32) / 2.0
            else:
                rep = acc_p
            store_rotated(okrow, acc_1, acc_2, acc_r, rep, freq, dh, hm, dr, rest_m, HALF, wm, KMAX, HAS_REST)
        store_clamped(OV + ovbase + mat[:, None] * DV + dv[None, :], acc_v, wm[:, None] & dvm[None, :], VMAX)
        tl.store(OP + opbase + mat, (start + fm).to(tl.int64), mask=wm)
        tl.store(OE + opbase + mat, (start + lm + 1).to(tl.int64), mask=wm)
    else:
        r = (pid_blk - n_wblk) * BT + tl.arange(0, BT)
        rm = r < n_raw
        src = tl.where(r < first, r, r + nw * G).to(tl.int64)
        dst = tl.where(r < first, r, r + kept + nw).to(tl.int64)
        copy_raw_tokens(K, V, OK, OV, OP, kbase, vbase, okbase, ovbase, opbase, src, dst, rm,
                        sks, skd, svs, svd, DK, DV, dk, dv, dkm, dvm)
        tl.store(OE + opbase + dst, src + 1, mask=rm)


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
) -> Compressed:
    """Triton version of :func:`.naive.keep_and_pool` (same arguments, same result).

    The host computes the plan from the mask (:func:`.naive.keep_and_pool_plan`: integer tensors of the size of
    the mask, not of the keys): every raw window token's output index, each window's merged-entry index and
    its first and last member. One launch then copies the raw tokens, merges every window's members (un-rotated
    relative to the window start, weighted, re-rotated at the representative position) and writes positions and
    ends.
    """
    check_pool_arguments(weighting, rope, scores, inv_freq)
    use_scores = weighting == "score"
    require(keys, values, layout, mode="keep_and_pool", rope=rope, inv_freq=inv_freq,
            scores=scores if use_scores else None, raw=raw)
    if layout.n_windows == 0:
        b, h, n = keys.shape[:3]
        pos = torch.arange(n, device=keys.device).expand(b, h, n)
        return Compressed(keys, values, pos, pos + 1)
    plan = keep_and_pool_plan(raw, layout)
    b, h, n, dkk = keys.shape
    dvv = values.shape[-1]
    G, nw, kept = layout.stride, layout.n_windows, plan["kept"]
    cl = n - nw * G + kept + nw
    out_k = torch.empty((b, h, cl, dkk), dtype=keys.dtype, device=keys.device)
    out_v = torch.empty((b, h, cl, dvv), dtype=values.dtype, device=values.device)
    out_p = torch.empty((b, h, cl), dtype=torch.long, device=keys.device)
    out_e = torch.empty_like(out_p)
    first = layout.first.to(device=keys.device, dtype=torch.long).contiguous()
    raw8 = raw.to(torch.int8).contiguous()
    # output index of every raw window token, laid out like the mask (other entries are never read)
    out_index = torch.zeros((b, h, n), dtype=torch.int32, device=keys.device)
    win_pos = layout.window_positions().flatten(2)
    out_index.scatter_(2, win_pos, plan["slot_out"].flatten(2).to(torch.int32))
    merged_at = (plan["base"] + plan["first_member"]).to(torch.int32).contiguous()
    fm = plan["first_member"].to(torch.int32).contiguous()
    lm = plan["last_member"].to(torch.int32).contiguous()

    n_raw = n - nw * G
    sc, freq, half, n_wblk, n_blocks, meta = pool_launch(  # the same tile budget as the pool kernel
        keys, values, scores, use_scores, rope, inv_freq, fm, G, nw, n_raw
    )
    _keep_pool_kernel[(n_blocks, b * h)](
        keys, values, sc, raw8, out_index, first, merged_at, fm, lm, freq, out_k, out_v, out_p, out_e,
        h, n, cl, nw, G, n_raw, n_wblk, kept, half,
        *keys.stride(), *values.stride(), *sc.stride()[:3],
        dkk, dvv,
        **meta,
        num_warps=4,
    )
    return Compressed(out_k, out_v, out_p, out_e)
