"""The built-in model: a small Llama trained on this package's task generators, shipped with it.

It is what ``kvpress-phase eval`` uses when no ``--model`` is given. How it was trained, and what it can do, is
in ``MODEL_CARD.md``; ``python -m kvpress_phase.evaluation.train_builtin_model`` rebuilds it.
"""

from __future__ import annotations

import os

_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin_model")


def builtin_model_path() -> str:
    """Directory of the built-in model (Hugging Face format: config, safetensors weights, tokenizer)."""
    if not os.path.isfile(os.path.join(_DIR, "config.json")):
        raise FileNotFoundError(
            f"the built-in model is missing from {_DIR}; rebuild it with "
            "`python -m kvpress_phase.evaluation.train_builtin_model`"
        )
    return _DIR


def load_builtin_model(device: str = "cpu", dtype=None):
    """``(model, tokenizer)`` of the built-in model, loaded offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = builtin_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    return model.to(device).eval(), tokenizer
