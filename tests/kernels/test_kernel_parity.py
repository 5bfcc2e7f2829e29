"""Parity of the Triton kernels with the PyTorch references (kernels/naive.py, the specification).

The kernels run on CPU tensors through the Triton interpreter, which must be switched on before triton is first
imported: this module sets ``TRITON_INTERPRET=1`` at the top and skips itself, with the reason, when triton was
already imported without it. With ``KVPRESS_PHASE_TEST_CUDA=1`` on a machine with a GPU it runs the compiled
kernels on CUDA tensors instead.

Shapes are small (the interpreter executes every program in Python) and the parametrisation covers each axis
(dtype, head_dim, stride, window, offsets, staggered grids, ragged lengths, sink/local tokens, weighting, RoPE
mode, partial rotary, strided inputs) without taking their product.
"""

from __future__ import annotations

import os
import sys

_USE_CUDA = os.environ.get("KVPRESS_PHASE_TEST_CUDA", "0") not in ("", "0")
_TRITON_PRELOADED = "triton" in sys.modules
_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not _USE_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytestmark = pytest.mark.triton

pytest.importorskip("triton", reason="triton is not installed")

from kvpress_phase import kernels  # noqa: E402
from kvpress_phase.core.phase import WindowLayout  # noqa: E402

try:
    from kvpress_phase.kernels import triton_common, triton_pool, triton_select  # noqa: E402
except Exception as exc:  # pragma: no cover - a broken install
    pytest.skip(f"the Triton kernels do not import: {exc!r}", allow_module_level=True)

if _USE_CUDA:
    if not torch.cuda.is_available():
        pytest.skip("KVPRESS_PHASE_TEST_CUDA=1 but no CUDA device is available", allow_module_level=True)
    DEVICE = "cuda"
else:
    if not triton_common.interpreter_ready() or (_TRITON_PRELOADED and not _INTERPRET_BEFORE):
        pytest.skip(
            "the Triton interpreter is not active: triton was imported before this module set TRITON_INTERPRET=1; "
            "run `TRITON_INTERPRET=1 python -m pytest tests/kernels`",
            allow_module_level=True,
        )
    DEVICE = "cpu"

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.fixture(params=["auto", "tiny"])
def tiles(request, monkeypatch):
    """Run with the default tiles and with the smallest ones (every chunk loop, many blocks per row)."""
    monkeypatch.setattr(triton_common, "TILES", request.param)
    return request.param


# ---------------------------------------------------------------------------------------------- helpers
def _tolerance(dtype: torch.dtype, rope: str = "none") -> dict:
    if dtype == F32:
        # centroid: the representative position is a weighted sum of positions; a different summation order moves
        # it by an ulp of the position (about 1e-5 at position 150), i.e. the rotation angle by as much
        return dict(rtol=1e-5, atol=1e-4 if rope == "centroid" else 1e-5)
    return dict(rtol=1e-2, atol=1e-2)


def _assert_same(got, ref, dtype, rope="none", exact=False):
    for name, g, r in zip(("keys", "values", "positions"), got, ref):
        assert g.shape == r.shape, f"{name}: shape {tuple(g.shape)} != {tuple(r.shape)}"
        assert g.dtype == r.dtype, f"{name}: dtype {g.dtype} != {r.dtype}"
        g, r = g.cpu(), r.cpu()
        if name == "positions" or exact:
            assert torch.equal(g, r), f"{name} differ at {(g != r).nonzero()[:5].tolist()}"
        else:
            torch.testing.assert_close(g.float(), r.float(), **_tolerance(dtype, rope), msg=lambda m: f"{name}: {m}")


def _inv_freq(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)


def _inputs(batch, heads, seq, dim, dtype, *, dim_v=None, layout="contiguous", seed=0, scale=1.0):
    """keys, values, scores on DEVICE; ``layout="bshd"`` gives non-contiguous (batch, seq, heads, dim) storage,
    ``"expanded"`` a GQA-style broadcast of one KV head."""
    g = torch.Generator().manual_seed(seed)
    dim_v = dim_v or dim

    def make(d):
        if layout == "bshd":
            return (scale * torch.randn(batch, seq, heads, d, generator=g)).to(dtype).to(DEVICE).transpose(1, 2)
        if layout == "expanded":
            one = (scale * torch.randn(batch, 1, seq, d, generator=g)).to(dtype).to(DEVICE)
            return one.expand(batch, heads, seq, d)
        return (scale * torch.randn(batch, heads, seq, d, generator=g)).to(dtype).to(DEVICE)

    keys, values = make(dim), make(dim_v)
    scores = torch.randn(batch, heads, seq, generator=g).to(DEVICE)
    return keys, values, scores


def _layout(seq, window, stride, k, offsets, batch, heads, n_sink=0, n_local=0):
    if isinstance(offsets, str) and offsets == "staggered":
        offsets = torch.arange(batch * heads).reshape(batch, heads) * 3 + 1
    return WindowLayout.build(
        seq, window=window, stride=stride, k=k, offsets=offsets, n_sink=n_sink, n_local=n_local,
        batch=batch, heads=heads, device=DEVICE,
    )


def _pool_both(keys, values, layout, scores, weighting, rope, inv_freq):
    kw = dict(scores=scores, weighting=weighting, rope=rope, inv_freq=inv_freq)
    return (
        kernels.pool_windows(keys, values, layout, backend="triton", **kw),
        kernels.pool_windows(keys, values, layout, backend="torch", **kw),
    )


# ---------------------------------------------------------------------------------------------- select
# (dtype, head_dim, stride, k, offsets, batch, heads, seq, n_sink, n_local, scores kind)
SELECT_CASES = [
    (F32, 64, 4, 1, 0, 1, 2, 61, 0, 0, "randn"),
    (BF16, 128, 8, 3, 5, 2, 1, 100, 4, 8, "randn"),
    (F16, 80, 16, 5, "staggered", 1, 3, 131, 2, 5, "randn"),
    (F32, 96, 8, 4, [1, 6], 2, 2, 77, 3, 2, "ties"),
    (BF16, 256, 4, 2, "staggered", 2, 2, 45, 1, 1, "special"),
    (F32, 64, 16, 16, 3, 1, 1, 90, 0, 7, "randn"),  # k == window: nothing dropped
    (F16, 64, 8, 2, 2, 1, 2, 40, 4, 4, "ties"),
    (F32, 64, 6, 4, "staggered", 1, 2, 71, 2, 3, "randn"),  # stride not a power of two
    (BF16, 64, 1, 1, 0, 1, 1, 40, 0, 0, "randn"),  # stride 1: every window keeps its token
]


@pytest.mark.parametrize("dtype,dim,stride,k,offsets,batch,heads,seq,n_sink,n_local,kind", SELECT_CASES)
def test_select_parity(dtype, dim, stride, k, offsets, batch, heads, seq, n_sink, n_local, kind, tiles):
    keys, values, scores = _inputs(batch, heads, seq, dim, dtype, seed=seq)
    if kind == "ties":  # few distinct values: ties must go to the earlier token
        scores = torch.randint(0, 3, scores.shape, generator=torch.Generator().manual_seed(1)).float().to(DEVICE)
    elif kind == "special":  # NaN ranks above everything, -inf/+inf at the ends, bf16 scores
        scores = scores.clone()
        scores[..., 7::11] = float("nan")
        scores[..., 3::13] = float("-inf")
        scores[..., 5::17] = float("inf")
        scores = scores.to(BF16)
    layout = _layout(seq, stride, stride, k, offsets, batch, heads, n_sink, n_local)
    assert layout.n_windows > 0
    got = kernels.select_windows(keys, values, scores, layout, backend="triton")
    ref = kernels.select_windows(keys, values, scores, layout, backend="torch")
    _assert_same(got, ref, dtype, exact=True)


# ---------------------------------------------------------------------------------------------- pool
# (dtype, head_dim, window, stride, k, offsets, batch, heads, seq, n_sink, n_local, weighting, rope, rotary_dim)
POOL_CASES = [
    (F32, 64, 4, 4, 2, 0, 1, 2, 64, 0, 0, "mean", "none", None),
    (F32, 64, 8, 8, 3, 2, 2, 1, 83, 4, 3, "score", "none", None),
    (F32, 128, 16, 8, 2, "staggered", 1, 3, 120, 4, 2, "mean", "start", 128),  # W = 2S, slots past the end
    (F32, 80, 8, 8, 3, [0, 5], 1, 2, 97, 2, 3, "score", "center", 40),  # partial rotary
    (F32, 96, 32, 16, 5, "staggered", 2, 2, 150, 1, 0, "score", "centroid", 96),
    (F32, 64, 16, 16, 1, 7, 1, 1, 200, 0, 16, "mean", "centroid", 32),  # k = 1: one group spans the window
    (BF16, 128, 8, 4, 3, "staggered", 2, 2, 70, 3, 1, "score", "start", 128),  # W = 2S, k not dividing S
    (BF16, 64, 8, 8, 4, 1, 1, 3, 101, 4, 4, "mean", "none", None),
    (BF16, 256, 16, 16, 4, "staggered", 1, 2, 90, 2, 5, "score", "centroid", 128),
    (F16, 96, 4, 4, 1, 3, 2, 1, 57, 1, 2, "score", "center", 64),
    (F16, 80, 16, 8, 4, "staggered", 1, 2, 111, 0, 0, "mean", "centroid", 80),
    (F16, 128, 32, 16, 8, 9, 1, 1, 140, 4, 16, "score", "none", None),
    (BF16, 64, 4, 4, 4, "staggered", 1, 2, 48, 0, 3, "mean", "start", 64),  # k == window
    (F32, 96, 12, 6, 4, "staggered", 2, 1, 87, 3, 2, "score", "center", 96),  # stride 6, overlapping groups
    (F32, 64, 2, 1, 1, 0, 1, 1, 41, 1, 0, "score", "centroid", 64),  # stride 1, W = 2
]


@pytest.mark.parametrize(
    "dtype,dim,window,stride,k,offsets,batch,heads,seq,n_sink,n_local,weighting,rope,rotary_dim", POOL_CASES
)
def test_pool_parity(dtype, dim, window, stride, k, offsets, batch, heads, seq, n_sink, n_local, weighting, rope,
                     rotary_dim, tiles):
    keys, values, scores = _inputs(batch, heads, seq, dim, dtype, seed=seq + dim)
    scores = 3 * scores
    layout = _layout(seq, window, stride, k, offsets, batch, heads, n_sink, n_local)
    assert layout.n_windows > 0
    inv_freq = _inv_freq(rotary_dim).to(DEVICE) if rotary_dim else None
    got, ref = _pool_both(keys, values, layout, scores, weighting, rope, inv_freq)
    _assert_same(got, ref, dtype, rope)


@pytest.mark.parametrize(
    "storage,dtype,weighting,rope",
    [("bshd", BF16, "score", "centroid"), ("expanded", F32, "mean", "start"), ("bshd", F32, "mean", "none")],
)
def test_pool_strided_inputs(storage, dtype, weighting, rope):
    """Non-contiguous keys/values (a (batch, seq, heads, dim) cache, a broadcast KV head) and strided scores."""
    batch, heads, seq, dim = 2, 3, 75, 64
    keys, values, _ = _inputs(batch, heads, seq, dim, dtype, layout=storage, seed=3)
    assert not keys.is_contiguous()
    scores = torch.randn(batch, seq, heads).to(DEVICE).transpose(1, 2)  # strided scores
    layout = _layout(seq, 2 * 8, 8, 3, "staggered", batch, heads, n_sink=2, n_local=4)
    got, ref = _pool_both(keys, values, layout, scores, weighting, rope, _inv_freq(64).to(DEVICE))
    _assert_same(got, ref, dtype, rope)


def test_select_strided_inputs():
    batch, heads, seq, dim = 1, 3, 66, 96
    keys, values, _ = _inputs(batch, heads, seq, dim, F16, layout="bshd", seed=4)
    scores = torch.randn(batch, seq, heads).to(DEVICE).transpose(1, 2)
    layout = _layout(seq, 8, 8, 3, "staggered", batch, heads, n_sink=1, n_local=2)
    got = kernels.select_windows(keys, values, scores, layout, backend="triton")
    ref = kernels.select_windows(keys, values, scores, layout, backend="torch")
    _assert_same(got, ref, F16, exact=True)


def test_values_with_their_own_head_dim():
    batch, heads, seq = 1, 2, 60
    keys, values, scores = _inputs(batch, heads, seq, 64, BF16, dim_v=96, seed=5)
    layout = _layout(seq, 8, 8, 2, [1, 4], batch, heads, n_sink=2, n_local=2)
    got, ref = _pool_both(keys, values, layout, scores, "score", "center", _inv_freq(48).to(DEVICE))
    _assert_same(got, ref, BF16, "center")
    # the reference select gathers values with the keys' head_dim, so compare each half on its own
    got = kernels.select_windows(keys, values, scores, layout, backend="triton")
    ref_k = kernels.select_windows(keys, keys, scores, layout, backend="torch")
    ref_v = kernels.select_windows(values, values, scores, layout, backend="torch")
    _assert_same(got, (ref_k.keys, ref_v.values, ref_k.positions), BF16, exact=True)


def test_pool_clamps_to_the_finite_range():
    """Re-rotating a merged key can grow a component by up to sqrt(2): the cast back clamps instead of overflowing.

    float16 only: bfloat16's range is float32's, so its merged keys would overflow the float32 accumulator first.
    """
    dtype = F16
    batch, heads, seq, dim = 1, 1, 40, 64
    fmax = torch.finfo(dtype).max
    keys = torch.full((batch, heads, seq, dim), 0.9 * fmax, dtype=dtype).to(DEVICE)
    keys[..., dim // 4 : dim // 2] = -0.9 * fmax
    values = torch.full_like(keys, 0.95 * fmax)
    layout = _layout(seq, 4, 4, 1, 1, batch, heads, n_sink=1, n_local=1)
    got, ref = _pool_both(keys, values, layout, None, "mean", "start", _inv_freq(dim).to(DEVICE) * 0.37)
    assert torch.isfinite(got.keys.float()).all()
    assert (got.keys.float().abs() == torch.finfo(dtype).max).any(), "the case should reach the clamp"
    _assert_same(got, ref, dtype, "start")


def test_no_window_passes_through():
    keys, values, scores = _inputs(1, 2, 20, 64, F32)
    layout = _layout(20, 8, 8, 2, 0, 1, 2, n_sink=4, n_local=8)
    assert layout.n_windows == 0
    got = kernels.pool_windows(keys, values, layout, backend="triton")
    _assert_same(got, kernels.pool_windows(keys, values, layout, backend="torch"), F32, exact=True)
    got = kernels.select_windows(keys, values, scores, layout, backend="triton")
    _assert_same(got, kernels.select_windows(keys, values, scores, layout, backend="torch"), F32, exact=True)


# ---------------------------------------------------------------------------------------------- keep and pool
def _raw_mask(layout, n_keep, seed):
    """A mask that keeps ``n_keep`` window tokens per row (at most ``stride - 1`` per window), at random."""
    g = torch.Generator().manual_seed(seed)
    pos = layout.window_positions().cpu()  # (B, H, nw, S)
    key = torch.rand(pos.shape, generator=g)
    key.scatter_(-1, torch.randint(0, layout.stride, pos.shape[:-1] + (1,), generator=g), -1.0)  # one pooled
    top = key.flatten(2).topk(n_keep, dim=-1).indices
    keep = torch.zeros(key.flatten(2).shape, dtype=torch.bool).scatter_(-1, top, True)
    raw = torch.ones(layout.batch, layout.heads, layout.seq_len, dtype=torch.bool)
    return raw.scatter_(2, pos.flatten(2), keep).to(DEVICE)


# (dtype, head_dim, pool window, offsets, batch, heads, seq, n_sink, n_local, kept share, weighting, rope, rotary)
KEEP_POOL_CASES = [
    (F32, 64, 8, 0, 1, 2, 70, 2, 4, 0.5, "mean", "start", 64),
    (BF16, 128, 32, 3, 2, 1, 150, 4, 16, 0.6, "mean", "start", 128),
    (F16, 80, 16, "staggered", 1, 3, 131, 2, 5, 0.3, "score", "centroid", 64),
    (F32, 96, 12, [1, 6], 2, 2, 97, 3, 2, 0.0, "mean", "center", 96),  # nothing kept: one entry per window
    (F32, 64, 8, 2, 1, 2, 80, 1, 1, 0.8, "score", "none", 0),
    (BF16, 64, 4, "staggered", 2, 2, 45, 1, 1, 0.5, "mean", "start", 32),  # partial rotary
]


@pytest.mark.parametrize("dtype,dim,size,offsets,batch,heads,seq,n_sink,n_local,share,weighting,rope,rotary_dim",
                         KEEP_POOL_CASES)
def test_keep_and_pool_parity(dtype, dim, size, offsets, batch, heads, seq, n_sink, n_local, share, weighting, rope,
                              rotary_dim, tiles):
    keys, values, scores = _inputs(batch, heads, seq, dim, dtype, seed=seq + size)
    layout = _layout(seq, size, size, 1, offsets, batch, heads, n_sink, n_local)
    assert layout.n_windows > 0
    raw = _raw_mask(layout, int(share * layout.n_windows * (size - 1)), seed=seq)
    inv_freq = _inv_freq(rotary_dim).to(DEVICE) if rotary_dim else None
    kw = dict(scores=3 * scores, weighting=weighting, rope=rope, inv_freq=inv_freq)
    got = kernels.keep_and_pool(keys, values, raw, layout, backend="triton", **kw)
    ref = kernels.keep_and_pool(keys, values, raw, layout, backend="torch", **kw)
    _assert_same(got, ref, dtype, rope)
    assert torch.equal(got.ends.cpu(), ref.ends.cpu())


def test_keep_and_pool_refuses_a_mask_without_a_member():
    keys, values, _ = _inputs(1, 1, 40, 64, F32)
    layout = _layout(40, 8, 8, 1, 0, 1, 1, 0, 0)
    raw = torch.ones(1, 1, 40, dtype=torch.bool, device=DEVICE)  # every window token raw: nothing to pool
    with pytest.raises(ValueError, match="at least one token to pool"):
        kernels.keep_and_pool(keys, values, raw, layout, backend="triton")


@pytest.mark.parametrize("seed", range(24))
def test_random_configurations(seed, monkeypatch):
    """Random draws over every axis at once, with the GPU tile sizes, the smallest ones or the interpreter's."""
    rng = torch.Generator().manual_seed(1000 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    def between(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=rng))

    monkeypatch.setattr(triton_common, "TILES", ("device", "tiny", "auto")[seed % 3])
    mode = "select" if seed % 4 == 0 else "pool"
    dtype = pick([F32, BF16, F16])
    dim = pick([64, 80, 96, 128, 256])
    stride = pick([4, 8, 16])
    window = stride if mode == "select" else pick([stride, 2 * stride])
    k = between(1, stride)
    batch, heads = between(1, 2), between(1, 3)
    n_sink, n_local = between(0, 6), pick([0, 1, 3, stride, 17])
    seq = between(n_sink + n_local + 2 * stride, 200)
    offsets = pick([0, between(0, stride - 1), "staggered", torch.randint(0, stride, (batch, heads), generator=rng)])
    storage = pick(["contiguous", "contiguous", "bshd", "expanded"])
    keys, values, scores = _inputs(batch, heads, seq, dim, dtype, layout=storage, seed=seed)
    layout = _layout(seq, window, stride, k, offsets, batch, heads, n_sink, n_local)
    if mode == "select":
        if seed % 8 == 0:
            scores = scores.round()  # ties
        got = kernels.select_windows(keys, values, scores, layout, backend="triton")
        ref = kernels.select_windows(keys, values, scores, layout, backend="torch")
        _assert_same(got, ref, dtype, exact=True)
        return
    weighting, rope = pick(["mean", "score"]), pick(["none", "start", "center", "centroid"])
    rotary_dim = pick([dim, dim, dim // 2, 16])
    got, ref = _pool_both(keys, values, layout, 2 * scores, weighting, rope, _inv_freq(rotary_dim).to(DEVICE))
    _assert_same(got, ref, dtype, rope)


# ---------------------------------------------------------------------------------------------- unsupported
def _unsupported_cases():
    keys, values, scores = _inputs(1, 2, 64, 64, F32)
    layout = _layout(64, 8, 8, 2, 0, 1, 2)
    overlap = _layout(64, 16, 8, 2, 0, 1, 2)
    wide = _layout(4200, 2048, 2048, 2, 0, 1, 2)
    k_wide, v_wide, _ = _inputs(1, 2, 4200, 16, F32)
    big_dim = torch.zeros(1, 2, 64, 512, device=DEVICE)
    return {
        "float64 keys": ("pool", keys.double(), values.double(), layout, {}),
        "int8 values": ("select", keys, values.to(torch.int8), layout, {"scores": scores}),
        "head_dim 512": ("pool", big_dim, big_dim, layout, {}),
        "select with window 2S": ("select", keys, values, overlap, {"scores": scores}),
        "select window too wide": ("select", k_wide, v_wide, wide, {"scores": torch.zeros(1, 2, 4200, device=DEVICE)}),
        "rotary dim > head_dim": ("pool", keys, values, layout, {"rope": "start", "inv_freq": _inv_freq(96)}),
        "scores of the wrong shape": ("select", keys, values, layout, {"scores": scores[:, :1]}),
        "layout of another shape": ("pool", keys[:, :1], values[:, :1], layout, {}),
        "3-D keys": ("pool", keys[0], values[0], layout, {}),
    }


@pytest.mark.parametrize("name", list(_unsupported_cases()))
def test_unsupported_inputs_are_refused(name):
    mode, keys, values, layout, kw = _unsupported_cases()[name]
    reason = triton_common.unsupported(keys, values, layout, mode=mode, **kw)
    assert isinstance(reason, str) and reason, name
    # forced Triton through the single dispatch point: ValueError, never a silent result
    with pytest.raises(ValueError):
        if mode == "select":
            kernels.select_windows(keys, values, kw["scores"], layout, backend="triton")
        else:
            kernels.pool_windows(keys, values, layout, backend="triton", rope=kw.get("rope", "none"),
                                 inv_freq=kw.get("inv_freq"))
    # the kernel entry points refuse it too when called directly
    with pytest.raises(ValueError):
        if mode == "select":
            triton_select.select_windows(keys, values, kw["scores"], layout)
        else:
            triton_pool.pool_windows(keys, values, layout, rope=kw.get("rope", "none"), inv_freq=kw.get("inv_freq"))


def test_supported_inputs_have_no_reason():
    keys, values, scores = _inputs(1, 2, 64, 80, BF16, layout="bshd")
    layout = _layout(64, 16, 8, 2, "staggered", 1, 2)
    assert triton_common.unsupported(keys, values, layout, mode="pool", rope="centroid", inv_freq=_inv_freq(40)) is None
    layout = _layout(64, 8, 8, 2, "staggered", 1, 2)
    assert triton_common.unsupported(keys, values, layout, mode="select", scores=scores) is None


def test_auto_falls_back_with_one_warning(monkeypatch):
    """Under ``auto`` an unsupported input takes the reference path with a warning (once per reason)."""
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    monkeypatch.setattr(kernels, "resolve_backend", lambda tensor, backend=None: "triton")
    monkeypatch.setattr(kernels, "_warned", set())
    keys, values, _ = _inputs(1, 2, 64, 64, F32)
    keys, values = keys.double(), values.double()
    layout = _layout(64, 8, 8, 2, 0, 1, 2)
    with pytest.warns(UserWarning, match="PyTorch reference"):
        got = kernels.pool_windows(keys, values, layout)
    ref = kernels.pool_windows(keys, values, layout, backend="torch")
    _assert_same(got, ref, F32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels.pool_windows(keys, values, layout)  # same reason: no second warning
