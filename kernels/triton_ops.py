"""Fused Triton kernels for the chunked-stride compression ops.

Both ops read every needed key and value once and write the whole compressed cache (raw tokens, window
entries and the positions tensor) in a single launch. They return exactly what :mod:`.naive` (the
specification) returns, within floating-point tolerance for pooling and bit for bit for selection.

Grid: ``(n_window_blocks + n_raw_blocks, batch * heads)``. Axis 1 picks the (batch, head) row, so every row can
have its own first window (``layout.first``). On axis 0, the first ``n_window_blocks`` programs each handle
``BNW`` consecutive windows of that row; the remaining programs copy ``BT`` of the row's raw tokens (those
before the first window and after the last one; there are ``seq_len - n_windows * stride`` of them in every row)
to their output slots.

- select: a program loads the scores of its windows as a ``(BNW, S)`` tile, ranks every slot against the
  whole window in chunks of ``BI`` slots (``rank_i = #{j : s_j > s_i or (s_j == s_i and j < i)}``, NaN above
  everything, as the stable descending sort of the reference), keeps ``rank < k``, numbers the kept slots in
  order with a prefix sum, and gathers only the kept rows of keys and values into their output slots.
- pool: for each of the ``k`` groups (bounds from :func:`~kvpress_phase.phase.group_bounds`), a program walks
  the group's slots in chunks of ``BL`` (two extra passes over the scores for the softmax when weighting by
  score), turns the keys back to the window start in float32 (angles ``(position - window_start) * inv_freq``
  computed in the kernel, as the reference does, so precision does not degrade with position; the rotary halves
  and the untouched rest of a partial-rotary head are separate tiles), accumulates the weighted sums of keys,
  values and (for ``rope="centroid"``) positions in float32, turns the merged key on to its representative
  position, clamps to the output dtype's finite range and stores.

Slots past the end of the sequence read the last token, as in the reference. Strided (non-contiguous) keys,
values and scores are read through their strides; outputs are contiguous.

Import needs only torch and triton. The kernels run on CUDA tensors, and on CPU tensors when
``TRITON_INTERPRET=1`` was set before triton was first imported.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from kvpress_phase.phase import WindowLayout, group_bounds

from .naive import ROPE_MODES, Compressed, check_pool_arguments, keep_and_pool_plan

__all__ = ["unsupported", "select_windows", "pool_windows", "keep_and_pool", "MAX_HEAD_DIM", "MAX_SELECT_WINDOW", "DTYPES"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCORE_DTYPES = DTYPES + (torch.float64,)
MAX_HEAD_DIM = 256
MAX_SELECT_WINDOW = 1024
_MAX_ROWS = 65535  # grid axis 1 limit
_INT32_MAX = 2**31 - 1
_ROPE_CODE = {"none": 0, "start": 1, "center": 2, "centroid": 3}
_SIZE_ARGS = ["n", "cl", "nw", "n_raw", "n_wblk"]


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _row_offsets(H, cl, skb, skh, svb, svh, ssb, ssh, DK, DV):
    """The (batch, head) row of this program (grid axis 1) and its base offsets: into keys, values and scores
    through their strides, and into the contiguous outputs (keys, values, positions) of ``cl`` entries a row."""
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    row = pid_bh.to(tl.int64)
    return row, b * skb + h * skh, b * svb + h * svh, b * ssb + h * ssh, row * cl * DK, row * cl * DV, row * cl


@triton.jit
def _head_dims(DK, DV, BDK: tl.constexpr, BDV: tl.constexpr):
    """The key and value head-dimension tiles and their masks."""
    dk = tl.arange(0, BDK)
    dv = tl.arange(0, BDV)
    return dk, dv, dk < DK, dv < DV


@triton.jit
def _rotary_tile(INVF, HALF, BH: tl.constexpr):
    """The tile of one rotary half, its mask, and the inverse frequencies (float32, ``(BH,)``)."""
    dh = tl.arange(0, BH)
    hm = dh < HALF
    return dh, hm, tl.load(INVF + dh, mask=hm, other=0.0)


@triton.jit(do_not_specialize=_SIZE_ARGS)
def _select_kernel(
    K, V, SC, FIRST, OK, OV, OP,
    H, n, cl, nw, S, KSEL, n_raw, n_wblk,
    skb, skh, sks, skd, svb, svh, svs, svd, ssb, ssh, sss,
    DK, DV,
    BNW: tl.constexpr, BI: tl.constexpr, BS: tl.constexpr,
    BDK: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr,
):
    pid_blk = tl.program_id(0)
    row, kbase, vbase, sbase, okbase, ovbase, opbase = _row_offsets(H, cl, skb, skh, svb, svh, ssb, ssh, DK, DV)
    first = tl.load(FIRST + row).to(tl.int32)
    dk, dv, dkm, dvm = _head_dims(DK, DV, BDK, BDV)

    if pid_blk < n_wblk:
        w = pid_blk * BNW + tl.arange(0, BNW)
        wm = w < nw
        start = first + w * S  # (BNW,)
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
            src64 = src.to(tl.int64)
            km = keep[:, :, None] & dkm[None, None, :]
            x = tl.load(K + kbase + src64[:, :, None] * sks + dk[None, None, :] * skd, mask=km)
            tl.store(OK + okbase + dst[:, :, None] * DK + dk[None, None, :], x, mask=km)
            vm = keep[:, :, None] & dvm[None, None, :]
            y = tl.load(V + vbase + src64[:, :, None] * svs + dv[None, None, :] * svd, mask=vm)
            tl.store(OV + ovbase + dst[:, :, None] * DV + dv[None, None, :], y, mask=vm)
            tl.store(OP + opbase + dst, src64, mask=keep)
    else:
        r = (pid_blk - n_wblk) * BT + tl.arange(0, BT)
        rm = r < n_raw
        src = tl.where(r < first, r, r + nw * S).to(tl.int64)
        dst = tl.where(r < first, r, r + nw * KSEL).to(tl.int64)
        km = rm[:, None] & dkm[None, :]
        x = tl.load(K + kbase + src[:, None] * sks + dk[None, :] * skd, mask=km)
        tl.store(OK + okbase + dst[:, None] * DK + dk[None, :], x, mask=km)
        vm = rm[:, None] & dvm[None, :]
        y = tl.load(V + vbase + src[:, None] * svs + dv[None, :] * svd, mask=vm)
        tl.store(OV + ovbase + dst[:, None] * DV + dv[None, :], y, mask=vm)
        tl.store(OP + opbase + dst, src, mask=rm)


@triton.jit(do_not_specialize=_SIZE_ARGS)
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
    row, kbase, vbase, sbase, okbase, ovbase, opbase = _row_offsets(H, cl, skb, skh, svb, svh, ssb, ssh, DK, DV)
    first = tl.load(FIRST + row).to(tl.int32)
    dk, dv, dkm, dvm = _head_dims(DK, DV, BDK, BDV)

    if pid_blk < n_wblk:
        w = pid_blk * BNW + tl.arange(0, BNW)
        wm = w < nw
        start = first + w * S  # (BNW,)
        last = n - 1
        if ROPE != 0:
            dh, hm, freq = _rotary_tile(INVF, HALF, BH)
            if HAS_REST:
                dr = tl.arange(0, BR)
                rest_m = dr < DK - 2 * HALF
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
                    s = tl.load(SC + sbase + p.to(tl.int64) * sss, mask=m2, other=float("-inf")).to(tl.float32)
                    gmax = tl.maximum(gmax, tl.max(s, axis=1), propagate_nan=tl.PropagateNan.ALL)
                gsum = tl.zeros([BNW], dtype=tl.float32)
                for c0 in range(0, glen, BL):
                    jj = c0 + tl.arange(0, BL)
                    m2 = wm[:, None] & (jj < glen)[None, :]
                    p = tl.minimum(gstart[:, None] + jj[None, :], last)
                    s = tl.load(SC + sbase + p.to(tl.int64) * sss, mask=m2, other=0.0).to(tl.float32)
                    gsum += tl.sum(tl.where(m2, tl.exp(s - gmax[:, None]), 0.0), axis=1)
            acc_v = tl.zeros([BNW, BDV], dtype=tl.float32)
            if ROPE == 0:
                acc_k = tl.zeros([BNW, BDK], dtype=tl.float32)
            else:
                acc_1 = tl.zeros([BNW, BH], dtype=tl.float32)
                acc_2 = tl.zeros([BNW, BH], dtype=tl.float32)
                if HAS_REST:
                    acc_r = tl.zeros([BNW, BR], dtype=tl.float32)
                if ROPE == 3:
                    acc_p = tl.zeros([BNW], dtype=tl.float32)
            for c0 in range(0, glen, BL):
                jj = c0 + tl.arange(0, BL)
                m2 = wm[:, None] & (jj < glen)[None, :]
                p = tl.minimum(gstart[:, None] + jj[None, :], last)  # (BNW, BL)
                p64 = p.to(tl.int64)
                if SCORE:
                    s = tl.load(SC + sbase + p64 * sss, mask=m2, other=0.0).to(tl.float32)
                    wt = tl.where(m2, tl.exp(s - gmax[:, None]) / gsum[:, None], 0.0)
                else:
                    wt = tl.where(m2, 1.0 / glen.to(tl.float32), 0.0)
                wt3 = wt[:, :, None]
                m3 = m2[:, :, None]
                krow = K + kbase + p64[:, :, None] * sks
                if ROPE == 0:
                    x = tl.load(krow + dk[None, None, :] * skd, mask=m3 & dkm[None, None, :], other=0.0)
                    acc_k += tl.sum(wt3 * x.to(tl.float32), axis=1)
                else:
                    mh = m3 & hm[None, None, :]
                    x1 = tl.load(krow + dh[None, None, :] * skd, mask=mh, other=0.0).to(tl.float32)
                    x2 = tl.load(krow + (dh + HALF)[None, None, :] * skd, mask=mh, other=0.0).to(tl.float32)
                    # un-rotating at p and re-rotating at rep is one rotation by rep - p, split at the window
                    # start: slots turn by -(p - start) here, merged entries by rep - start below
                    ang = (p - start[:, None]).to(tl.float32)[:, :, None] * freq[None, None, :]
                    cos = tl.cos(ang)
                    sin = tl.sin(ang)
                    # un-rotate: rotation by -angle
                    acc_1 += tl.sum(wt3 * (x1 * cos + x2 * sin), axis=1)
                    acc_2 += tl.sum(wt3 * (x2 * cos - x1 * sin), axis=1)
                    if HAS_REST:
                        xr = tl.load(
                            krow + (2 * HALF + dr)[None, None, :] * skd, mask=m3 & rest_m[None, None, :], other=0.0
                        )
                        acc_r += tl.sum(wt3 * xr.to(tl.float32), axis=1)
                    if ROPE == 3:
                        acc_p += tl.sum(wt * (p - gpos[:, None]).to(tl.float32), axis=1)
                y = tl.load(
                    V + vbase + p64[:, :, None] * svs + dv[None, None, :] * svd,
                    mask=m3 & dvm[None, None, :],
                    other=0.0,
                )
                acc_v += tl.sum(wt3 * y.to(tl.float32), axis=1)

            dst = (first + w * KSEL + g).to(tl.int64)  # (BNW,)
            okrow = OK + okbase + dst[:, None] * DK
            if ROPE == 0:
                out_k = acc_k
                if KMAX > 0:
                    out_k = tl.clamp(out_k, -KMAX, KMAX, propagate_nan=tl.PropagateNan.ALL)
                tl.store(okrow + dk[None, :], out_k.to(OK.dtype.element_ty), mask=wm[:, None] & dkm[None, :])
            else:
                # representative position, relative to the window start
                if ROPE == 1:
                    rep = (gpos - start).to(tl.float32)
                elif ROPE == 2:
                    gend = tl.minimum(start + ghi - 1, last)
                    rep = (gpos + gend - 2 * start).to(tl.float32) / 2.0
                else:
                    rep = (gpos - start).to(tl.float32) + acc_p
                ang = rep[:, None] * freq[None, :]
                cos = tl.cos(ang)
                sin = tl.sin(ang)
                out_1 = acc_1 * cos - acc_2 * sin
                out_2 = acc_2 * cos + acc_1 * sin
                if KMAX > 0:
                    out_1 = tl.clamp(out_1, -KMAX, KMAX, propagate_nan=tl.PropagateNan.ALL)
                    out_2 = tl.clamp(out_2, -KMAX, KMAX, propagate_nan=tl.PropagateNan.ALL)
                mh = wm[:, None] & hm[None, :]
                tl.store(okrow + dh[None, :], out_1.to(OK.dtype.element_ty), mask=mh)
                tl.store(okrow + (dh + HALF)[None, :], out_2.to(OK.dtype.element_ty), mask=mh)
                if HAS_REST:
                    out_r = acc_r
                    if KMAX > 0:
                        out_r = tl.clamp(out_r, -KMAX, KMAX, propagate_nan=tl.PropagateNan.ALL)
                    rm2 = wm[:, None] & rest_m[None, :]
                    tl.store(okrow + (2 * HALF + dr)[None, :], out_r.to(OK.dtype.element_ty), mask=rm2)
            out_v = acc_v
            if VMAX > 0:
                out_v = tl.clamp(out_v, -VMAX, VMAX, propagate_nan=tl.PropagateNan.ALL)
            ovrow = OV + ovbase + dst[:, None] * DV
            tl.store(ovrow + dv[None, :], out_v.to(OV.dtype.element_ty), mask=wm[:, None] & dvm[None, :])
            tl.store(OP + opbase + dst, gpos.to(tl.int64), mask=wm)
    else:
        r = (pid_blk - n_wblk) * BT + tl.arange(0, BT)
        rm = r < n_raw
        src = tl.where(r < first, r, r + nw * S).to(tl.int64)
        dst = tl.where(r < first, r, r + nw * KSEL).to(tl.int64)
        km = rm[:, None] & dkm[None, :]
        x = tl.load(K + kbase + src[:, None] * sks + dk[None, :] * skd, mask=km)
        tl.store(OK + okbase + dst[:, None] * DK + dk[None, :], x, mask=km)
        vm = rm[:, None] & dvm[None, :]
        y = tl.load(V + vbase + src[:, None] * svs + dv[None, :] * svd, mask=vm)
        tl.store(OV + ovbase + dst[:, None] * DV + dv[None, :], y, mask=vm)
        tl.store(OP + opbase + dst, src, mask=rm)


@triton.jit(do_not_specialize=["n", "cl", "nw", "n_raw", "n_wblk", "kept"])
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
    row, kbase, vbase, sbase, okbase, ovbase, opbase = _row_offsets(H, cl, skb, skh, svb, svh, ssb, ssh, DK, DV)
    rbase = row * n
    first = tl.load(FIRST + row).to(tl.int32)
    dk, dv, dkm, dvm = _head_dims(DK, DV, BDK, BDV)

    if pid_blk < n_wblk:
        w = pid_blk * BNW + tl.arange(0, BNW)
        wm = w < nw
        start = first + w * G  # (BNW,)
        wrow = row * nw + w
        fm = tl.load(FM + wrow, mask=wm, other=0)
        lm = tl.load(LM + wrow, mask=wm, other=0)
        mat = tl.load(MAT + wrow, mask=wm, other=0).to(tl.int64)
        if ROPE != 0:
            dh, hm, freq = _rotary_tile(INVF, HALF, BH)
            if HAS_REST:
                dr = tl.arange(0, BR)
                rest_m = dr < DK - 2 * HALF
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
                s = tl.load(SC + sbase + p.to(tl.int64) * sss, mask=mem, other=float("-inf")).to(tl.float32)
                s = tl.where(mem, s, float("-inf"))
                gmax = tl.maximum(gmax, tl.max(s, axis=1), propagate_nan=tl.PropagateNan.ALL)
        if SCORE:
            gsum = tl.zeros([BNW], dtype=tl.float32)
            for c0 in range(0, G, BL):
                jj = c0 + tl.arange(0, BL)
                m2 = wm[:, None] & (jj < G)[None, :]
                p = start[:, None] + jj[None, :]
                r = tl.load(RAW + rbase + p.to(tl.int64), mask=m2, other=1)
                mem = m2 & (r == 0)
                s = tl.load(SC + sbase + p.to(tl.int64) * sss, mask=mem, other=0.0).to(tl.float32)
                gsum += tl.sum(tl.where(mem, tl.exp(s - gmax[:, None]), 0.0), axis=1)
        # pass 2: copy the raw slots, accumulate the members
        acc_v = tl.zeros([BNW, BDV], dtype=tl.float32)
        if ROPE == 0:
            acc_k = tl.zeros([BNW, BDK], dtype=tl.float32)
        else:
            acc_1 = tl.zeros([BNW, BH], dtype=tl.float32)
            acc_2 = tl.zeros([BNW, BH], dtype=tl.float32)
            if HAS_REST:
                acc_r = tl.zeros([BNW, BR], dtype=tl.float32)
            if ROPE == 3:
                acc_p = tl.zeros([BNW], dtype=tl.float32)
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
            km = keep[:, :, None] & dkm[None, None, :]
            x = tl.load(K + kbase + p64[:, :, None] * sks + dk[None, None, :] * skd, mask=km)
            tl.store(OK + okbase + dst[:, :, None] * DK + dk[None, None, :], x, mask=km)
            vm = keep[:, :, None] & dvm[None, None, :]
            y = tl.load(V + vbase + p64[:, :, None] * svs + dv[None, None, :] * svd, mask=vm)
            tl.store(OV + ovbase + dst[:, :, None] * DV + dv[None, None, :], y, mask=vm)
            tl.store(OP + opbase + dst, p64, mask=keep)
            tl.store(OE + opbase + dst, p64 + 1, mask=keep)
            # members are merged
            if SCORE:
                s = tl.load(SC + sbase + p64 * sss, mask=mem, other=0.0).to(tl.float32)
                wt = tl.where(mem, tl.exp(s - gmax[:, None]) / gsum[:, None], 0.0)
            else:
                wt = tl.where(mem, 1.0 / tl.maximum(n_mem, 1.0)[:, None], 0.0)
            wt3 = wt[:, :, None]
            m3 = mem[:, :, None]
            krow = K + kbase + p64[:, :, None] * sks
            if ROPE == 0:
                xk = tl.load(krow + dk[None, None, :] * skd, mask=m3 & dkm[None, None, :], other=0.0)
                acc_k += tl.sum(wt3 * xk.to(tl.float32), axis=1)
            else:
                mh = m3 & hm[None, None, :]
                x1 = tl.load(krow + dh[None, None, :] * skd, mask=mh, other=0.0).to(tl.float32)
                x2 = tl.load(krow + (dh + HALF)[None, None, :] * skd, mask=mh, other=0.0).to(tl.float32)
                ang = jj.to(tl.float32)[None, :, None] * freq[None, None, :]  # slot = position - window start
                cos = tl.cos(ang)
                sin = tl.sin(ang)
                acc_1 += tl.sum(wt3 * (x1 * cos + x2 * sin), axis=1)
                acc_2 += tl.sum(wt3 * (x2 * cos - x1 * sin), axis=1)
                if HAS_REST:
                    xr = tl.load(krow + (2 * HALF + dr)[None, None, :] * skd, mask=m3 & rest_m[None, None, :],
                                 other=0.0)
                    acc_r += tl.sum(wt3 * xr.to(tl.float32), axis=1)
                if ROPE == 3:
                    acc_p += tl.sum(wt * jj.to(tl.float32)[None, :], axis=1)
            ym = m3 & dvm[None, None, :]
            yv = tl.load(V + vbase + p64[:, :, None] * svs + dv[None, None, :] * svd, mask=ym, other=0.0)
            acc_v += tl.sum(wt3 * yv.to(tl.float32), axis=1)

        okrow = OK + okbase + mat[:, None] * DK
        if ROPE == 0:
            out_k = acc_k
            if KMAX > 0:
                out_k = tl.clamp(out_k, -KMAX, KMAX, propagate_nan=tl.PropagateNan.ALL)
            tl.store(okrow + dk[None, :], out_k.to(OK.dtype.element_ty), mask=wm[:, None] & dkm[None, :])
        else:
            if ROPE == 1:
                rep = fm.to(tl.float32)
            elif ROPE == 2:
                rep = (fm + lm).to(tl.float32) / 2.0
            else:
                rep = acc_p
            ang = rep[:, None] * freq[None, :]
            cos = tl.cos(ang)
            sin = tl.sin(ang)
            out_1 = acc_1 * cos - acc_2 * sin
            out_2 = acc_2 * cos + acc_1 * sin
            if KMAX > 0:
                out_1 = tl.clamp(out_1, -KMAX, KMAX, propagate_nan=tl.PropagateNan.ALL)
                out_2 = tl.clamp(out_2, -KMAX, KMAX, propagate_nan=tl.PropagateNan.ALL)
            mh = wm[:, None] & hm[None, :]
            tl.store(okrow + dh[None, :], out_1.to(OK.dtype.element_ty), mask=mh)
            tl.store(okrow + (dh + HALF)[None, :], out_2.to(OK.dtype.element_ty), mask=mh)
            if HAS_REST:
                out_r = acc_r
                if KMAX > 0:
                    out_r = tl.clamp(out_r, -KMAX, KMAX, propagate_nan=tl.PropagateNan.ALL)
                tl.store(okrow + (2 * HALF + dr)[None, :], out_r.to(OK.dtype.element_ty),
                         mask=wm[:, None] & rest_m[None, :])
        out_v = acc_v
        if VMAX > 0:
            out_v = tl.clamp(out_v, -VMAX, VMAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(OV + ovbase + mat[:, None] * DV + dv[None, :], out_v.to(OV.dtype.element_ty),
                 mask=wm[:, None] & dvm[None, :])
        tl.store(OP + opbase + mat, (start + fm).to(tl.int64), mask=wm)
        tl.store(OE + opbase + mat, (start + lm + 1).to(tl.int64), mask=wm)
    else:
        r = (pid_blk - n_wblk) * BT + tl.arange(0, BT)
        rm = r < n_raw
        src = tl.where(r < first, r, r + nw * G).to(tl.int64)
        dst = tl.where(r < first, r, r + kept + nw).to(tl.int64)
        km = rm[:, None] & dkm[None, :]
        x = tl.load(K + kbase + src[:, None] * sks + dk[None, :] * skd, mask=km)
        tl.store(OK + okbase + dst[:, None] * DK + dk[None, :], x, mask=km)
        vm = rm[:, None] & dvm[None, :]
        y = tl.load(V + vbase + src[:, None] * svs + dv[None, :] * svd, mask=vm)
        tl.store(OV + ovbase + dst[:, None] * DV + dv[None, :], y, mask=vm)
        tl.store(OP + opbase + dst, src, mask=rm)
        tl.store(OE + opbase + dst, src + 1, mask=rm)


# ---------------------------------------------------------------------------------------------- host side
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpreter_ready() -> bool:
    """Whether the kernels and triton.language's own jitted helpers (sum, cumsum, ...) were built for the
    interpreter: that is decided when triton and this module are first imported, not at launch."""
    jit_function = triton.runtime.jit.JITFunction
    return not isinstance(_pool_kernel, jit_function) and not isinstance(tl.cumsum, jit_function)


TILES = "auto"
"""Tile sizes: ``"auto"`` (large tiles, few programs under the interpreter; register-friendly tiles on a GPU),
``"device"`` (the GPU tiles everywhere) or ``"tiny"`` (smallest tiles, so that small test shapes run every chunk
loop and many blocks per row)."""


def _profile() -> str:
    if TILES not in ("auto", "device", "tiny"):
        raise ValueError(f"TILES must be 'auto', 'device' or 'tiny', got {TILES!r}")
    if TILES == "auto":
        return "interpreter" if _interpreting() else "device"
    return TILES


def _pow2(x: int) -> int:
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
    if keys.device.type != "cuda" and not (keys.device.type == "cpu" and _interpreting()):
        return f"the kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {keys.device}"
    if keys.device.type == "cpu" and not _interpreter_ready():
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


def _require(keys, values, layout, **kw) -> None:
    reason = unsupported(keys, values, layout, **kw)
    if reason is not None:
        raise ValueError(f"the Triton kernel does not support this input: {reason}")


def _passthrough(keys: torch.Tensor, values: torch.Tensor) -> Compressed:
    b, h, n = keys.shape[:3]
    return Compressed(keys, values, torch.arange(n, device=keys.device).expand(b, h, n))


def _outputs(keys, values, layout):
    b, h = keys.shape[:2]
    cl = layout.compressed_length
    out_k = torch.empty((b, h, cl, keys.shape[-1]), dtype=keys.dtype, device=keys.device)
    out_v = torch.empty((b, h, cl, values.shape[-1]), dtype=values.dtype, device=values.device)
    out_p = torch.empty((b, h, cl), dtype=torch.long, device=keys.device)
    first = layout.first.to(device=keys.device, dtype=torch.long).contiguous()
    return out_k, out_v, out_p, first


@functools.lru_cache(maxsize=64)
def _group_tables(window: int, stride: int, k: int, device: torch.device):
    """Group bounds as int32 device tensors, built once per (window, stride, k, device): a host-to-device copy
    on every call would synchronise the stream."""
    lo, hi = group_bounds(window, stride, k)
    lo_t = torch.tensor(lo, dtype=torch.int32, device=device)
    hi_t = torch.tensor(hi, dtype=torch.int32, device=device)
    return lo_t, hi_t, max(h - l for l, h in zip(lo, hi))


def _raw_block(n_raw: int, bd: int, profile: str) -> int:
    if profile == "interpreter":
        return min(_pow2(n_raw), 256)
    if profile == "tiny":
        return 4
    return max(4, min(128, 2048 // bd))


def select_windows(
    keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, layout: WindowLayout
) -> Compressed:
    """Triton version of :func:`.naive.select_windows` (same arguments, same result)."""
    if layout.window != layout.stride:
        raise ValueError(f"select needs window == stride, got window={layout.window}, stride={layout.stride}")
    if scores is None:
        raise ValueError("select needs scores")
    _require(keys, values, layout, mode="select", scores=scores)
    if layout.n_windows == 0:
        return _passthrough(keys, values)
    b, h, n, dkk = keys.shape
    dvv = values.shape[-1]
    S, k, nw = layout.stride, layout.k, layout.n_windows
    out_k, out_v, out_p, first = _outputs(keys, values, layout)
    profile = _profile()
    bdk, bdv = max(16, _pow2(dkk)), max(16, _pow2(dvv))
    bs = _pow2(S)
    if profile == "interpreter":  # few large programs: the interpreter pays per program, not per element
        bi = bs
        bnw = min(_pow2(nw), 32)
    elif profile == "tiny":
        bi, bnw = min(bs, 2), 2
    else:  # (BNW, BI, head_dim) gather tile <= 2K elements, (BNW, BI, S) ranking tile <= 4K (about 120 registers)
        bi = min(bs, 16, max(1, 4096 // bs))
        bnw = max(1, min(32, 2048 // (bi * max(bdk, bdv)), 4096 // (bi * bs)))
    n_raw = n - nw * S
    bt = _raw_block(n_raw, max(bdk, bdv), profile)
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
    _require(keys, values, layout, mode="pool", rope=rope, inv_freq=inv_freq, scores=scores if use_scores else None)
    if layout.n_windows == 0:
        return _passthrough(keys, values)

    b, h, n, dkk = keys.shape
    dvv = values.shape[-1]
    W, S, k, nw = layout.window, layout.stride, layout.k, layout.n_windows
    out_k, out_v, out_p, first = _outputs(keys, values, layout)
    lo_t, hi_t, gmax = _group_tables(W, S, k, keys.device)

    code = _ROPE_CODE[rope]
    if code:
        freq = inv_freq.to(device=keys.device, dtype=torch.float32).contiguous()
        half = freq.numel()
    else:
        freq = lo_t  # placeholder pointer, never read
        half = 0
    bh_, br = max(16, _pow2(half)), max(16, _pow2(dkk - 2 * half))
    has_rest = bool(code) and dkk > 2 * half
    bdk, bdv = max(16, _pow2(dkk)), max(16, _pow2(dvv))
    sc = scores if use_scores else keys  # placeholder pointer when unused
    profile = _profile()
    if profile == "interpreter":
        bl = min(_pow2(gmax), 64)
        bnw = min(_pow2(nw), 32)
    elif profile == "tiny":
        bl, bnw = min(_pow2(gmax), 2), 2
    else:  # float32 tiles of <= 1K elements (<= 256 per rotary half: cos/sin and both halves are live at once)
        bl = min(_pow2(gmax), 16, max(1, 1024 // max(bdk, bdv)))
        if code:
            bl = min(bl, max(1, 256 // bh_), max(1, 256 // br) if has_rest else bl)
        limit = 1024 // (bl * max(bdk, bdv))
        if code:
            limit = min(limit, 256 // (bl * bh_), 256 // (bl * br) if has_rest else limit)
        bnw = max(1, min(32, limit))
    n_raw = n - nw * S
    bt = _raw_block(n_raw, max(bdk, bdv), profile)
    n_wblk = triton.cdiv(nw, bnw)
    grid = (n_wblk + triton.cdiv(n_raw, bt), b * h)
    _pool_kernel[grid](
        keys, values, sc, first, lo_t, hi_t, freq, out_k, out_v, out_p,
        h, n, layout.compressed_length, nw, S, k, n_raw, n_wblk, half,
        *keys.stride(), *values.stride(), *sc.stride()[:3],
        dkk, dvv,
        SCORE=use_scores, ROPE=code, HAS_REST=has_rest,
        KMAX=_fmax(keys.dtype), VMAX=_fmax(values.dtype),
        BNW=bnw, BL=bl, BDK=bdk, BDV=bdv, BH=bh_, BR=br, BT=bt,
        num_warps=4,
    )
    return Compressed(out_k, out_v, out_p)


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
    _require(keys, values, layout, mode="keep_and_pool", rope=rope, inv_freq=inv_freq,
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

    code = _ROPE_CODE[rope]
    if code:
        freq = inv_freq.to(device=keys.device, dtype=torch.float32).contiguous()
        half = freq.numel()
    else:
        freq = fm  # placeholder pointer, never read
        half = 0
    bh_, br = max(16, _pow2(half)), max(16, _pow2(dkk - 2 * half))
    has_rest = bool(code) and dkk > 2 * half
    bdk, bdv = max(16, _pow2(dkk)), max(16, _pow2(dvv))
    sc = scores if use_scores else keys  # placeholder pointer when unused
    profile = _profile()
    if profile == "interpreter":
        bl, bnw = min(_pow2(G), 64), min(_pow2(nw), 32)
    elif profile == "tiny":
        bl, bnw = min(_pow2(G), 2), 2
    else:  # the same tile budget as the pool kernel
        bl = min(_pow2(G), 16, max(1, 1024 // max(bdk, bdv)))
        if code:
            bl = min(bl, max(1, 256 // bh_), max(1, 256 // br) if has_rest else bl)
        limit = 1024 // (bl * max(bdk, bdv))
        if code:
            limit = min(limit, 256 // (bl * bh_), 256 // (bl * br) if has_rest else limit)
        bnw = max(1, min(32, limit))
    n_raw = n - nw * G
    bt = _raw_block(n_raw, max(bdk, bdv), profile)
    n_wblk = triton.cdiv(nw, bnw)
    grid = (n_wblk + triton.cdiv(n_raw, bt), b * h)
    _keep_pool_kernel[grid](
        keys, values, sc, raw8, out_index, first, merged_at, fm, lm, freq, out_k, out_v, out_p, out_e,
        h, n, cl, nw, G, n_raw, n_wblk, kept, half,
        *keys.stride(), *values.stride(), *sc.stride()[:3],
        dkk, dvv,
        SCORE=use_scores, ROPE=code, HAS_REST=has_rest,
        KMAX=_fmax(keys.dtype), VMAX=_fmax(values.dtype),
        BNW=bnw, BL=bl, BDK=bdk, BDV=bdv, BH=bh_, BR=br, BT=bt,
        num_warps=4,
    )
    return Compressed(out_k, out_v, out_p, out_e)
