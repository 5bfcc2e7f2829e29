"""The layer below the presses and the kernels: phase arithmetic (:mod:`.phase`) and RoPE handling (:mod:`.rope`).

Both modules import only torch and nothing else from kvpress_phase, so that ``kvpress_phase.kernels`` (which
imports them) never depends on the presses or on the package root, whose lazy attributes lead to the presses.
They are imported by these paths alone (``from kvpress_phase.core.phase import WindowLayout``); the
package root also offers ``kvpress_phase.WindowLayout`` and ``kvpress_phase.phase_of`` lazily.
"""
