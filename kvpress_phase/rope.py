"""RoPE handling: rotating keys and finding a layer's inverse frequencies (public path).

The code lives in :mod:`kvpress_phase.core.rope`, below both the presses and the kernels; this module re-exports
it so that ``from kvpress_phase.rope import rotate`` keeps working. Only torch is imported.
"""

from kvpress_phase.core.rope import add_rotated_, rotary_inv_freq, rotate

__all__ = ["add_rotated_", "rotary_inv_freq", "rotate"]
