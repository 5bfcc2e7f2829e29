"""Triton kernel for attention over a ragged, head-flattened KV cache: flash-decoding over variable-length heads.

Triton version of :func:`.naive_ragged.ragged_attention` (the specification; same layout and semantics: each KV head's
entries in ``starts[h] .. starts[h] + lengths[h] - 1`` of one buffer, the ``n_new`` queries causal within the newest
``n_new`` entries, a zero output for a query that sees nothing).

Two launches:

1. ``_split_kernel``, grid ``(kv_heads, n_splits)``: one program per KV head and split of its entries (``SPLIT``
   consecutive entries, the same for every head; a head shorter than a split's start writes an empty partial). It
   loads the ``group * n_new`` query rows of the head's group as one tile, walks its split in blocks of ``BN``
   entries with an online softmax (running max ``m``, sum ``l``, float32 accumulator), and writes its partial
   ``(m, l, acc)`` to float32 workspaces. A head is never padded to the longest one: a program reads only its own
   head's rows, and splits past a head's end do no work.
2. ``_combine_kernel``, grid ``(kv_heads, ceil(group * n_new / BM))``: merges every split's partial of each query
   row (rescaled to the global max) and stores ``acc / l`` in the query's dtype (0 where ``l == 0``).

Products run in float32 with IEEE precision, so float32 inputs match the reference closely; bfloat16 and float16
inputs are read and converted to float32.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["ragged_attention", "unsupported"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
MAX_QUERY_ROWS = 128
"""Query rows one program holds (``group * n_new``): a decoding step's group, not a prefill."""


@triton.jit
def _split_kernel(
    Q, K, V, STARTS, LENGTHS, PM, PL, PACC,
    n_new, group, rows, n_splits, SPLIT, scale,
    sqh, sqn, sqd, skn, skd, svn, svd,
    D, DV,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
):
    h = tl.program_id(0)
    s = tl.program_id(1)
    start = tl.load(STARTS + h).to(tl.int64)
    length = tl.load(LENGTHS + h).to(tl.int32)
    r = tl.arange(0, BM)  # query row of the group: head h * group + r // n_new, token r % n_new
    rm = r < rows
    qh = (h * group + r // n_new).to(tl.int64)
    qt = (r % n_new).to(tl.int64)
    d = tl.arange(0, BD)
    dm = d < D
    dv = tl.arange(0, BDV)
    dvm = dv < DV
    q = tl.load(Q + qh[:, None] * sqh + qt[:, None] * sqn + d[None, :].to(tl.int64) * sqd,
                mask=rm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    limit = length - n_new + 1 + (r % n_new)  # entries each row sees: 0 .. limit - 1
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BDV], dtype=tl.float32)
    lo = s * SPLIT
    hi = tl.minimum(lo + SPLIT, length)
    for j0 in range(lo, hi, BN):
        j = j0 + tl.arange(0, BN)
        jm = j < hi
        k = tl.load(K + (start + j.to(tl.int64))[:, None] * skn + d[None, :].to(tl.int64) * skd,
                    mask=jm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        v = tl.load(V + (start + j.to(tl.int64))[:, None] * svn + dv[None, :].to(tl.int64) * svd,
                    mask=jm[:, None] & dvm[None, :], other=0.0).to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (BM, BN)
        seen = jm[None, :] & (j[None, :] < limit[:, None]) & rm[:, None]
        qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    base = (h * n_splits + s).to(tl.int64) * BM
    tl.store(PM + base + r, m_i)
    tl.store(PL + base + r, l_i)
    tl.store(PACC + (base + r.to(tl.int64))[:, None] * BDV + dv[None, :], acc)


@triton.jit
def _combine_kernel(
    PM, PL, PACC, O,
    n_new, group, rows, n_splits,
    soh, son, sod,
    DV,
    BM: tl.constexpr, BDV: tl.constexpr,
):
    h = tl.program_id(0)
    r = tl.arange(0, BM)
    rm = r < rows
    dv = tl.arange(0, BDV)
    m_tot = tl.full([BM], float("-inf"), dtype=tl.float32)
    for s in range(0, n_splits):
        base = (h * n_splits + s).to(tl.int64) * BM
        m_tot = tl.maximum(m_tot, tl.load(PM + base + r))
    m_safe = tl.where(m_tot == float("-inf"), 0.0, m_tot)
    l_tot = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BDV], dtype=tl.float32)
    for s in range(0, n_splits):
        base = (h * n_splits + s).to(tl.int64) * BM
        w = tl.exp(tl.load(PM + base + r) - m_safe)
        l_tot += tl.load(PL + base + r) * w
        acc += tl.load(PACC + (base + r.to(tl.int64))[:, None] * BDV + dv[None, :]) * w[:, None]
    out = tl.where(l_tot[:, None] > 0, acc / tl.where(l_tot > 0, l_tot, 1.0)[:, None], 0.0)
    qh = (h * group + r // n_new).to(tl.int64)
    qt = (r % n_new).to(tl.int64)
    tl.store(O + qh[:, None] * soh + qt[:, None] * son + dv[None, :].to(tl.int64) * sod,
             out.to(O.dtype.element_ty), mask=rm[:, None] & (dv[None, :] < DV))


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def unsupported(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_heads: int) -> Optional[str]:
    """Why the kernel cannot run these (already validated) inputs, or None."""
    rows = query.shape[0] // kv_heads * query.shape[1]
    if rows > MAX_QUERY_ROWS:
        return f"{rows} query rows per KV head (group * n_new), more than the {MAX_QUERY_ROWS} a program holds"
    if query.dtype not in DTYPES:
        return f"dtype {query.dtype} (the kernel takes {', '.join(str(t) for t in DTYPES)})"
    if max(keys.shape[1], values.shape[1]) > MAX_HEAD_DIM:
        return f"head_dim {max(keys.shape[1], values.shape[1])} > {MAX_HEAD_DIM}"
    if query.shape[1] == 0:
        return "no query token"
    return None


def ragged_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor,
                     lengths: torch.Tensor, scaling: Optional[float] = None, split: Optional[int] = None,
                     block: Optional[int] = None) -> torch.Tensor:
    """Triton version of :func:`.naive_ragged.ragged_attention` (same arguments and result). ``split`` (entries per
    split) defaults to what gives about four programs per multiprocessor of the GPU over every KV head (four splits
    per head on the CPU), ``block`` (entries per inner block) to 64 on a GPU; the tests set both small so that one
    head spans several splits and blocks."""
    q_heads, n_new, head_dim = query.shape
    kv_heads = starts.shape[0]
    group = q_heads // kv_heads
    rows = group * n_new
    reason = unsupported(query, keys, values, kv_heads)
    if reason is not None:
        raise ValueError(f"query: the varlen decoding kernel does not take {reason}")
    dv_ = values.shape[1]
    out = torch.empty(q_heads, n_new, dv_, dtype=query.dtype, device=query.device)
    longest = int(lengths.max()) if kv_heads else 0
    bn = block or (16 if query.device.type == "cpu" else 64)
    bn = max(16, _pow2(bn))
    if split is None:  # enough programs to fill the device (4 per multiprocessor), at least one block each
        target = 4
        if query.is_cuda:
            sms = torch.cuda.get_device_properties(query.device).multi_processor_count
            target = max(1, 4 * sms // kv_heads)
        split = max(bn, triton.cdiv(triton.cdiv(max(longest, 1), target), bn) * bn)
    split = max(bn, triton.cdiv(int(split), bn) * bn)
    n_splits = max(1, triton.cdiv(longest, split))
    bm = max(16, _pow2(rows))
    bd, bdv = max(16, _pow2(head_dim)), max(16, _pow2(dv_))
    f32 = dict(dtype=torch.float32, device=query.device)
    pm = torch.empty(kv_heads * n_splits * bm, **f32)
    pl = torch.empty(kv_heads * n_splits * bm, **f32)
    pacc = torch.empty(kv_heads * n_splits * bm, bdv, **f32)
    starts = starts.to(device=query.device, dtype=torch.int64).contiguous()
    lengths = lengths.to(device=query.device, dtype=torch.int32).contiguous()
    scale = head_dim ** -0.5 if scaling is None else float(scaling)
    _split_kernel[(kv_heads, n_splits)](
        query, keys, values, starts, lengths, pm, pl, pacc,
        n_new, group, rows, n_splits, split, scale,
        *query.stride(), *keys.stride(), *values.stride(),
        head_dim, dv_,
        BM=bm, BN=bn, BD=bd, BDV=bdv,
    )
    _combine_kernel[(kv_heads,)](
        pm, pl, pacc, out,
        n_new, group, rows, n_splits,
        *out.stride(),
        dv_,
        BM=bm, BDV=bdv,
    )
    return out
