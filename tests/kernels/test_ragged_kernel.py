"""Attention over ragged heads: the reference against padded attention, the Triton varlen kernel against the reference.

The reference (kernels/naive_ragged.py) is checked against an independent computation: every head padded to the
longest with its padding masked, one softmax in float64. The kernel (kernels/triton_varlen_decode.py) runs on CPU
tensors through the Triton interpreter (set up as in test_kernel_parity.py: TRITON_INTERPRET=1 before triton is
imported; with KVPRESS_PHASE_TEST_CUDA=1 on a GPU, the compiled kernel on CUDA tensors), with splits and blocks of
16 entries so that one head spans several of each.
"""

from __future__ import annotations

import os
import sys

_USE_CUDA = os.environ.get("KVPRESS_PHASE_TEST_CUDA", "0") not in ("", "0")
_TRITON_PRELOADED = "triton" in sys.modules
_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not _USE_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from kvpress_phase import kernels  # noqa: E402
from kvpress_phase.kernels import naive_ragged  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _case(lengths, group, n_new, dtype, head_dim=16, value_dim=None, slack=3, seed=0, device="cpu"):
    """Head-flattened buffers with ``slack`` unused rows before every head, and a query."""
    g = torch.Generator().manual_seed(seed)
    starts, row = [], 0
    for length in lengths:
        row += slack
        starts.append(row)
        row += length
    value_dim = value_dim or head_dim
    keys = torch.randn(row + slack, head_dim, generator=g).to(dtype).to(device)
    values = torch.randn(row + slack, value_dim, generator=g).to(dtype).to(device)
    query = torch.randn(len(lengths) * group, n_new, head_dim, generator=g).to(dtype).to(device)
    return query, keys, values, torch.tensor(starts, device=device), torch.tensor(lengths, device=device)


def _padded(query, keys, values, starts, lengths, scaling=None):
    """Every head padded to the longest, padding and the future masked, softmax in float64: zeros where a query
    sees nothing."""
    q_heads, n_new, d = query.shape
    kv_heads = len(lengths)
    group = q_heads // kv_heads
    longest = max(int(lengths.max()), 1)
    k = torch.zeros(kv_heads, longest, d, dtype=torch.float64)
    v = torch.zeros(kv_heads, longest, values.shape[1], dtype=torch.float64)
    for h, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        k[h, :n] = keys[s:s + n].double().cpu()
        v[h, :n] = values[s:s + n].double().cpu()
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = query.double().cpu() @ k.transpose(1, 2) * (d ** -0.5 if scaling is None else scaling)
    length = lengths.repeat_interleave(group).cpu()[:, None, None]
    col = torch.arange(longest)[None, None, :]
    row = torch.arange(n_new)[None, :, None]
    visible = (col < length) & (col <= length - n_new + row)
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


RAGGED = [([5, 0], 2, 1), ([1, 9, 0, 4], 1, 2), ([33], 4, 3), ([0, 0], 2, 1), ([17, 1, 40], 2, 3), ([2, 3], 1, 3)]


@pytest.mark.parametrize("lengths,group,n_new", RAGGED)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_reference_matches_padded_attention(lengths, group, n_new, dtype):
    case = _case(lengths, group, n_new, dtype)
    got = naive_ragged.ragged_attention(*case)
    assert got.shape == (len(lengths) * group, n_new, 16) and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == F32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.double(), _padded(*case), **tol)


def test_reference_reads_only_each_heads_rows():
    """Rows outside every head (slack) and other heads' rows change nothing; a head's own rows do."""
    query, keys, values, starts, lengths = _case([6, 3], 2, 1, F32)
    before = naive_ragged.ragged_attention(query, keys, values, starts, lengths)
    slack = torch.ones(keys.shape[0], dtype=torch.bool)
    for s, n in zip(starts.tolist(), lengths.tolist()):
        slack[s:s + n] = False
    noisy_k, noisy_v = keys.clone(), values.clone()
    noisy_k[slack], noisy_v[slack] = 1e4, 1e4
    assert torch.equal(naive_ragged.ragged_attention(query, noisy_k, noisy_v, starts, lengths), before)
    noisy_v[int(starts[1])] += 1.0
    after = naive_ragged.ragged_attention(query, noisy_k, noisy_v, starts, lengths)
    assert torch.equal(after[:2], before[:2]) and not torch.equal(after[2:], before[2:])


@pytest.mark.parametrize("bad,match", [
    (dict(query=torch.zeros(3, 1, 16)), "multiple"),
    (dict(lengths=torch.tensor([5, 50])), "inside"),
    (dict(lengths=torch.tensor([5.0, 1.0])), "integer"),
    (dict(keys=torch.zeros(17, 8)), "head_dim"),
    (dict(query=torch.zeros(4, 1, 16, dtype=BF16)), "dtype"),
])
def test_bad_input_is_refused_naming_it(bad, match):
    query, keys, values, starts, lengths = _case([5, 3], 2, 1, F32)
    args = dict(query=query, keys=keys, values=values, starts=starts, lengths=lengths) | bad
    with pytest.raises(ValueError, match=match):
        kernels.ragged_attention(**args, backend="torch")


def test_the_dispatch_uses_the_reference_on_cpu():
    case = _case([7, 2], 2, 2, F32)
    assert torch.equal(kernels.ragged_attention(*case, backend="torch"), naive_ragged.ragged_attention(*case))
    if not _USE_CUDA:
        assert kernels.resolve_backend(case[0], None) == "torch"


# ---------------------------------------------------------------------------------------------- the Triton kernel
def _triton():
    pytest.importorskip("triton", reason="triton is not installed")
    from kvpress_phase.kernels import triton_common

    if _USE_CUDA:
        if not torch.cuda.is_available():
            pytest.skip("KVPRESS_PHASE_TEST_CUDA=1 but no CUDA device is available")
        return "cuda"
    if not triton_common.interpreter_ready() or (_TRITON_PRELOADED and not _INTERPRET_BEFORE):
        pytest.skip("the Triton interpreter is not active: run `TRITON_INTERPRET=1 python -m pytest tests/kernels`")
    return "cpu"


@pytest.mark.triton
@pytest.mark.parametrize("lengths,group,n_new", RAGGED + [([64, 31, 0, 1], 2, 1)])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_kernel_matches_the_reference(lengths, group, n_new, dtype):
    device = _triton()
    from kvpress_phase.kernels import triton_varlen_decode

    case = _case(lengths, group, n_new, dtype, device=device)
    ref = naive_ragged.ragged_attention(*case)
    got = triton_varlen_decode.ragged_attention(*case, split=16, block=16)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == F32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.float(), ref.float(), **tol)


@pytest.mark.triton
def test_kernel_through_the_dispatch_with_its_own_splits():
    """Default split sizes, a value dim unlike the key dim, a scale: the forced Triton backend of the dispatch."""
    device = _triton()
    case = _case([70, 5, 0], 2, 2, F32, head_dim=32, value_dim=16, device=device)
    got = kernels.ragged_attention(*case, scaling=0.3, backend="triton")
    torch.testing.assert_close(got, naive_ragged.ragged_attention(*case, scaling=0.3), rtol=1e-5, atol=2e-6)


@pytest.mark.triton
def test_kernel_refuses_what_it_cannot_hold_when_forced():
    device = _triton()
    case = _case([4, 4], 64, 3, F32, device=device)  # 192 query rows per KV head
    with pytest.raises(ValueError, match="query rows"):
        kernels.ragged_attention(*case, backend="triton")
