"""The built-in model: a small Llama trained on this package's task generators, shipped with it.

It is what ``kvpress-phase eval`` uses when no ``--model`` is given. How it was trained, and what it can do, is
in ``MODEL_CARD.md``; ``python -m kvpress_phase.evaluation.train_builtin_model`` rebuilds it.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin_model")


def builtin_model_path() -> str:
    """Directory of the built-in model (Hugging Face format: config, safetensors weights, tokenizer)."""
    if not os.path.isfile(os.path.join(_DIR, "config.json")):
        raise FileNotFoundError(
            f"the built-in model is missing from {_DIR}; rebuild it with "
            "`python -m kvpress_phase.evaluation.train_builtin_model`"
        )
    return _DIR


def builtin_training_length() -> int:
    """Longest sequence, in tokens, the built-in model was trained on (from its ``training_log.json``)."""
    with open(os.path.join(builtin_model_path(), "training_log.json")) as fh:
        config = json.load(fh)["config"]
    return max(config["lengths"] + config.get("extend_lengths", []))


def is_builtin_model(model) -> bool:
    """Whether ``model`` (a loaded model) was loaded from the built-in model's directory."""
    path = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)
    return bool(path) and os.path.isdir(path) and os.path.samefile(path, _DIR)


@contextmanager
def quiet_loading():
    """Hide transformers' "Loading weights" progress bar (restored afterwards): the built-in model loads in well
    under a second, and the bar fills notebook outputs."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load_builtin_model(device: str = "cpu", dtype=None):
    """``(model, tokenizer)`` of the built-in model, loaded offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = builtin_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    return model.to(device).eval(), tokenizer
