"""The layer below the presses and the kernels: phase arithmetic (:mod:`.phase`) and RoPE handling (:mod:`.rope`).

Both modules import only torch and nothing else from kvpress_phase, so that ``kvpress_phase.kernels`` (which
imports them) never depends on the presses or on the package root, whose lazy attributes lead to the presses.
Their public paths are :mod:`kvpress_phase.phase` and :mod:`kvpress_phase.rope`, which re-export them.
"""
