"""Phase arithmetic: the window layouts and the phase of every token (public path).

The code lives in :mod:`kvpress_phase.core.phase`, below both the presses and the kernels; this module re-exports
its public names so that ``from kvpress_phase.phase import WindowLayout`` keeps working. Only torch is imported.
"""

from kvpress_phase.core.phase import (
    IntOrTensor,
    WindowLayout,
    check_number,
    check_ratio,
    compressed_length,
    group_bounds,
    group_membership,
    kept_per_window,
    merge_period,
    n_windows,
    phase_of,
    ratio_mismatch,
    window_ratio,
)

__all__ = [
    "IntOrTensor",
    "WindowLayout",
    "check_number",
    "check_ratio",
    "compressed_length",
    "group_bounds",
    "group_membership",
    "kept_per_window",
    "merge_period",
    "n_windows",
    "phase_of",
    "ratio_mismatch",
    "window_ratio",
]
