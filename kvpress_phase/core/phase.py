"""Phase arithmetic: the one place that knows how windows are laid over a sequence.

Chunked compression places windows of ``window`` (W) consecutive tokens every ``stride`` (S) tokens, starting at
``offset``. Every token then has a *phase*, its offset inside its stride block::

    phase = (position - offset) mod stride

A :class:`WindowLayout` says, for one sequence length, which positions are protected (the ``n_sink`` first and
``n_local`` last tokens, always kept raw), where each head's first window starts, how many windows are
compressed, and which raw tokens are left before and after them. Presses, kernels and the evaluation suite all
build their layouts here, so a phase means the same thing everywhere.

Only torch is imported, so the kernels can use this module on a machine without kvpress. The public path is
:mod:`kvpress_phase.core.phase`, which re-exports this module's public names.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

IntOrTensor = Union[int, torch.Tensor]


def check_number(name: str, value, low=None, high=None, *, integer: bool = True, open_high: bool = False):
    """``value`` as a Python int (``integer``) or float in ``[low, high]`` (``[low, high)`` with ``open_high``;
    either bound may be None); ``ValueError`` naming ``name`` otherwise.

    Python, numpy and 0-d torch numbers are accepted, bools never; with ``integer`` a float is refused even when it
    is whole. The presses validate their parameters with it too, so both refuse the same values.
    """
    number = value.item() if isinstance(value, torch.Tensor) and value.dim() == 0 else value
    kind = numbers.Integral if integer else numbers.Real
    if (isinstance(number, kind) and not isinstance(number, bool)
            and (low is None or number >= low)
            and (high is None or (number < high if open_high else number <= high))):
        return int(number) if integer else float(number)
    if low is None and high is None:
        allowed = ""
    elif high is None:
        allowed = f" >= {low}"
    elif low is None:
        allowed = f" {'<' if open_high else '<='} {high}"
    else:
        allowed = f" in [{low}, {high}{')' if open_high else ']'}"
    raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}{allowed}, got {value!r}")


def check_ratio(value, name: str = "compression_ratio") -> float:
    """A compression ratio: a number in ``[0, 1)`` (see :func:`check_number`)."""
    return check_number(name, value, 0, 1, integer=False, open_high=True)


def _check_positions(name: str, value) -> None:
    """``value`` is an integer or a tensor of integers (positions and offsets, of any sign)."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise ValueError(f"{name} must be an integer or a tensor of integers, got a {value.dtype} tensor")
    else:
        check_number(name, value)


def phase_of(position: IntOrTensor, stride: int, offset: IntOrTensor = 0) -> IntOrTensor:
    """Phase of ``position`` for windows placed every ``stride`` tokens starting at ``offset``.

    Works on Python ints and on integer tensors (broadcasting), and always returns a value in ``[0, stride)``.
    """
    stride = check_number("stride", stride, 1)
    _check_positions("position", position)
    _check_positions("offset", offset)
    return (position - offset) % stride


def kept_per_window(stride: int, compression_ratio: float) -> int:
    """Entries each window of ``stride`` tokens yields at ``compression_ratio``: the rounding rule.

    ``k`` is the integer nearest to ``stride * (1 - compression_ratio)``, with

    * ties going to more compression (``S * (1 - r) = 3.5`` gives 3, not Python's half-to-even 4);
    * a positive ratio never rounding to no compression where one fewer entry is possible (``k <= S - 1`` when
      ``r > 0`` and ``S > 1``);
    * at least one entry (``k >= 1``).

    So the per-window ratio achieved, :func:`window_ratio`, is ``1 - k / S``: within ``1 / (2S)`` of the request
    except where the last two rules apply (:func:`ratio_mismatch` says when).
    """
    stride, compression_ratio = check_number("stride", stride, 1), check_ratio(compression_ratio)
    exact = stride * (1.0 - compression_ratio)
    k = math.ceil(exact - 0.5 - 1e-9)  # nearest, ties down; the epsilon absorbs float error at exact ties
    if compression_ratio > 0 and stride > 1:
        k = min(k, stride - 1)
    return max(1, min(stride, k))


def window_ratio(stride: int, compression_ratio: float) -> float:
    """The per-window compression ratio achieved at a requested ``compression_ratio``: ``1 - k / S``."""
    stride = check_number("stride", stride, 1)
    return 1.0 - kept_per_window(stride, compression_ratio) / stride


def ratio_mismatch(stride: int, compression_ratio: float) -> Optional[str]:
    """Why the ratio achieved at ``stride`` is not the one requested (None when it is within ``1 / (2S)``).

    A positive ratio that still keeps every token (only possible at ``S = 1``) and an achieved per-window ratio
    more than ``1 / (2S)`` from the request are reported.
    """
    stride, compression_ratio = check_number("stride", stride, 1), check_ratio(compression_ratio)
    k = kept_per_window(stride, compression_ratio)
    achieved = 1.0 - k / stride
    if compression_ratio > 0 and k == stride:
        return (f"compression_ratio={compression_ratio:g} at stride {stride} keeps all {stride} tokens of every "
                "window: no compression")
    if abs(achieved - compression_ratio) > 1.0 / (2 * stride) + 1e-9:
        return (f"compression_ratio={compression_ratio:g} at stride {stride} keeps k={k} of {stride} tokens per "
                f"window, a per-window ratio of {achieved:g} (the nearest possible: ratios move in steps of "
                f"1/{stride})")
    return None


def n_windows(seq_len: int, stride: int, n_sink: int, n_local: int) -> int:
    """Number of windows compressed in a sequence of ``seq_len`` tokens.

    The compressible span is ``L = max(0, seq_len - n_sink - n_local)``. A grid with offset ``o`` leaves
    ``lead = (o - n_sink) mod S`` raw tokens before its first window, so at least ``(L - S + 1) // S`` windows
    fit whatever the offset. That is the number used for every offset, which makes the compressed length
    independent of the offset: aligned, shifted and staggered grids spend exactly the same cache.
    """
    seq_len, stride = check_number("seq_len", seq_len, 0), check_number("stride", stride, 1)
    n_sink, n_local = check_number("n_sink", n_sink, 0), check_number("n_local", n_local, 0)
    span = max(0, seq_len - n_sink - n_local)
    return max(0, (span - stride + 1) // stride)


def compressed_length(seq_len: int, stride: int, compression_ratio: float, n_sink: int = 4, n_local: int = 16) -> int:
    """Cache length after compression: ``seq_len - n_windows * (stride - k)``."""
    nw = n_windows(seq_len, stride, n_sink, n_local)  # validates all but the ratio, which kept_per_window does
    return int(seq_len) - nw * (int(stride) - kept_per_window(stride, compression_ratio))


def _check_window(window, stride, k) -> tuple[int, int, int]:
    """``window >= stride >= 1`` and ``1 <= k <= window``, as ints."""
    stride = check_number("stride", stride, 1)
    window = check_number("window", window, stride)
    return window, stride, check_number("k", k, 1, window)


def group_bounds(window: int, stride: int, k: int) -> tuple[list[int], list[int]]:
    """Slots ``[lo[g], hi[g])`` of a window that merged entry ``g`` (of ``k``) pools, in pool mode.

    Entries start every ``stride / k`` slots: ``lo[g] = floor(g * S / k)``. Each spans its share of the stride
    stretched by ``W / S``: ``hi[g] = lo[g] + ceil((floor((g + 1) * S / k) - lo[g]) * W / S)``. With ``W == S`` the
    groups partition the window; with ``W == 2 * S`` every token feeds two entries (of this window and the next)
    and no two entries of the sequence pool the same tokens.
    """
    window, stride, k = _check_window(window, stride, k)
    lo = [(g * stride) // k for g in range(k)]
    share = [((g + 1) * stride) // k - lo[g] for g in range(k)]
    hi = [lo[g] + -(-share[g] * window // stride) for g in range(k)]
    return lo, hi


def merge_period(stride: int, k: int) -> int:
    """Period, in slots, of the pool-mode merge pattern of a window: the smallest ``p`` dividing ``stride`` such
    that shifting the group starts of :func:`group_bounds` by ``p`` maps them onto themselves (mod ``stride``).

    ``k = 7`` of 8 merges only the last two slots (period 8); ``k = 6`` merges slots 2-3 and 6-7 (period 4);
    ``k = 4`` merges pairs (period 2). Grids shifted by a multiple of the period merge the same phases.
    """
    stride = check_number("stride", stride, 1)
    k = check_number("k", k, 1, stride)
    starts = set(group_bounds(stride, stride, k)[0])
    for p in range(1, stride + 1):
        if stride % p == 0 and all((b + p) % stride in starts for b in starts):
            return p
    return stride


def group_membership(window: int, stride: int, k: int, device=None) -> torch.Tensor:
    """``(window, k)`` float32 matrix, 1 where slot ``i`` feeds entry ``g`` (see :func:`group_bounds`)."""
    lo, hi = group_bounds(window, stride, k)
    i = torch.arange(int(window), device=device)[:, None]
    lo_t = torch.tensor(lo, device=device)
    hi_t = torch.tensor(hi, device=device)
    return ((i >= lo_t) & (i < hi_t)).to(torch.float32)


@dataclass(frozen=True)
class WindowLayout:
    """Where the windows of one sequence are, per batch row and KV head.

    Attributes
    ----------
    seq_len : int
        Number of tokens in the sequence (the cache length before compression).
    window, stride : int
        W and S. A window starting at position ``s`` covers ``[s, s + W)``; windows start every S tokens.
    k : int
        Entries each window yields.
    n_sink, n_local : int
        Protected tokens at the start and at the end, always kept raw.
    first : torch.Tensor
        ``(batch, heads)`` long tensor, position where each row's first compressed window starts.
        ``first >= n_sink`` and ``first - n_sink < stride``.
    n_windows : int
        Number of compressed windows, the same for every row (see :func:`n_windows`).
    offsets : torch.Tensor
        ``(batch, heads)`` long tensor, the grid offsets (phase 0 is at positions ``offset + j * stride``).
    """

    seq_len: int
    window: int
    stride: int
    k: int
    n_sink: int
    n_local: int
    offsets: torch.Tensor
    first: torch.Tensor
    n_windows: int

    @classmethod
    def build(
        cls,
        seq_len: int,
        *,
        window: int,
        stride: int,
        k: int,
        offsets: IntOrTensor | Sequence[int] = 0,
        n_sink: int = 0,
        n_local: int = 0,
        batch: int = 1,
        heads: int = 1,
        device=None,
    ) -> "WindowLayout":
        """Lay windows over a sequence of ``seq_len`` tokens.

        ``offsets`` is one int for all rows, a sequence of ``heads`` ints (one grid per head), or a tensor
        broadcastable to ``(batch, heads)``.
        """
        window, stride, k = _check_window(window, stride, k)
        seq_len = check_number("seq_len", seq_len, 0)
        n_sink, n_local = check_number("n_sink", n_sink, 0), check_number("n_local", n_local, 0)
        batch, heads = check_number("batch", batch, 1), check_number("heads", heads, 1)
        try:
            off = offsets if isinstance(offsets, torch.Tensor) else torch.as_tensor(offsets)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"offsets must be an int, a sequence of ints or an integer tensor, "
                             f"got {offsets!r}") from None
        _check_positions("offsets", off)
        if off.dim() > 2 or any(n not in (1, m) for n, m in zip(reversed(off.shape), (heads, batch))):
            raise ValueError(f"offsets of shape {tuple(off.shape)} do not fit batch={batch}, heads={heads}: give one "
                             f"int, {heads} ints (one per head) or a tensor broadcastable to ({batch}, {heads})")
        off = torch.broadcast_to(off.to(device=device, dtype=torch.long), (batch, heads)).clone() % stride
        first = n_sink + torch.remainder(off - n_sink, stride)
        return cls(
            seq_len=seq_len,
            window=window,
            stride=stride,
            k=k,
            n_sink=n_sink,
            n_local=n_local,
            offsets=off,
            first=first,
            n_windows=n_windows(seq_len, stride, n_sink, n_local),
        )

    # ------------------------------------------------------------------ derived quantities
    @property
    def batch(self) -> int:
        return self.first.shape[0]

    @property
    def heads(self) -> int:
        return self.first.shape[1]

    @property
    def uniform(self) -> bool:
        """True when every row uses the same grid (then the compressed cache is a concatenation of views)."""
        return bool((self.first == self.first.flatten()[0]).all())

    @property
    def compressed_length(self) -> int:
        return self.seq_len - self.n_windows * (self.stride - self.k)

    @property
    def achieved_ratio(self) -> float:
        """Fraction of the whole cache removed (the nominal ratio applies to windows only)."""
        return 0.0 if self.seq_len == 0 else 1.0 - self.compressed_length / self.seq_len

    def window_starts(self) -> torch.Tensor:
        """``(batch, heads, n_windows)`` start position of every compressed window."""
        j = torch.arange(self.n_windows, device=self.first.device)
        return self.first[..., None] + j * self.stride

    def window_positions(self) -> torch.Tensor:
        """``(batch, heads, n_windows, window)`` position of every slot of every window (may exceed seq_len)."""
        w = torch.arange(self.window, device=self.first.device)
        return self.window_starts()[..., None] + w

    def phases(self, positions: torch.Tensor) -> torch.Tensor:
        """Phase of ``positions`` (shape ``(batch, heads, ...)``) under each row's grid."""
        off = self.offsets.reshape(self.offsets.shape + (1,) * (positions.dim() - 2))
        return torch.remainder(positions - off, self.stride)

    def raw_source_index(self) -> torch.Tensor:
        """``(batch, heads, compressed_length)`` source position of each output slot that holds a raw token.

        Slots ``[0, first)`` hold tokens ``[0, first)``; slots from ``first + n_windows * k`` on hold the tokens
        after the last window. Window slots in between map to ``first`` (they are overwritten by the caller).
        """
        t = torch.arange(self.compressed_length, device=self.first.device)
        f = self.first[..., None]
        end = f + self.n_windows * self.k
        src = torch.where(t < f, t, t + self.n_windows * (self.stride - self.k))
        return torch.where((t >= f) & (t < end), f.expand_as(src), src)

    def window_slot_mask(self) -> torch.Tensor:
        """``(batch, heads, compressed_length)`` bool, True where an output slot holds a window entry."""
        t = torch.arange(self.compressed_length, device=self.first.device)
        f = self.first[..., None]
        return (t >= f) & (t < f + self.n_windows * self.k)
