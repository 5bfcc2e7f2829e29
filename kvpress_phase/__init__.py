"""kvpress-phase: chunked-stride KV-cache compression for kvpress, and the phase of every token.

The presses need kvpress (and therefore transformers); the phase arithmetic and the kernels need only torch.
Attributes are imported lazily so that ``import kvpress_phase.kernels`` works on a machine that has torch and
Triton but not kvpress. The sub-packages ``kvpress_phase.kernels``, ``.evaluation``, ``.training`` and ``.cli`` live in
the top-level folders ``kernels/``, ``evaluation/``, ``training/`` and ``cli/`` (pyproject.toml maps them): work from a
checkout through an editable install (``pip install -e .``), which imports every module by one path.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "ChunkedStridePress": "kvpress_phase.presses.chunked_stride_press",
    "PhaseAwarePress": "kvpress_phase.presses.phase_aware_press",
    "PerLayerWindowedPress": "kvpress_phase.presses.per_layer",
    "HeadBudgetPress": "kvpress_phase.presses.budget",
    "LayerBudgetPress": "kvpress_phase.presses.budget",
    "GlobalBudgetPress": "kvpress_phase.presses.budget",
    "StaggeredWindowPress": "kvpress_phase.presses.ablations",
    "WindowedDecodingPress": "kvpress_phase.presses.decoding",
    "LayerStats": "kvpress_phase.presses.stats",
    "CacheSummary": "kvpress_phase.presses.stats",
    "cache_summary": "kvpress_phase.presses.stats",
    "RaggedCache": "kvpress_phase.ragged",
    "cache_bytes": "kvpress_phase.ragged",
    "RaggedLayer": "kvpress_phase.ragged",
    "WindowLayout": "kvpress_phase.core.phase",
    "phase_of": "kvpress_phase.core.phase",
    "builtin_model_path": "kvpress_phase.builtin",
    "load_builtin_model": "kvpress_phase.builtin",
    "BUILTIN_MODELS": "kvpress_phase.builtin",
    "FinetuneConfig": "kvpress_phase.training.config",
    "finetune": "kvpress_phase.training.finetune",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvpress_phase' has no attribute {name!r}")


def __dir__():
    return __all__
