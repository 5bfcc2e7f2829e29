"""The built-in models: small Llamas trained on this package's task generators, shipped with it.

Two are registered (:data:`BUILTIN_MODELS`):

* ``"builtin"`` (the default): trained without compression. It is what ``kvpress-phase eval`` uses when no
  ``--model`` is given, the model of the post-hoc study (presses applied to a model that never saw a
  compressed cache). How it was trained, and what it can do, is in ``MODEL_CARD.md``;
  ``python -m kvpress_phase.training.train_builtin_model`` rebuilds it.
* ``"chunked"``: the same model fine-tuned with ``ChunkedStridePress`` in the loop (random ratios, strides and
  grid offsets), the trained-in regime. ``kvpress-phase train --recipe chunked`` builds it; until then its
  folder is absent and asking for it raises ``FileNotFoundError`` naming that command.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

_ROOT = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class BuiltinModel:
    """One registered built-in model: its folder inside the package, a description and how to build it."""

    name: str
    folder: str
    description: str
    build_command: str

    @property
    def path(self) -> str:
        return os.path.join(_ROOT, self.folder)

    @property
    def available(self) -> bool:
        return os.path.isfile(os.path.join(self.path, "config.json"))


DEFAULT_MODEL = "builtin"

BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in [
        BuiltinModel(
            "builtin", "builtin_model",
            "1.1M-parameter Llama trained without compression (the post-hoc study)",
            "python -m kvpress_phase.training.train_builtin_model",
        ),
        BuiltinModel(
            "chunked", "builtin_model_chunked",
            "the built-in model fine-tuned with ChunkedStridePress in the loop (ratios 0.25-0.875, strides 4-16, "
            "random grid offsets; the trained-in study)",
            "kvpress-phase train --recipe chunked --output-dir kvpress_phase/builtin_model_chunked",
        ),
    ]
}
"""Built-in models by name."""


def get_builtin_model(name: str = DEFAULT_MODEL) -> BuiltinModel:
    """The registry entry ``name``; ValueError listing the names otherwise."""
    try:
        return BUILTIN_MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown built-in model {name!r}; built-in models: {', '.join(BUILTIN_MODELS)}") from None


def builtin_model_path(name: str = DEFAULT_MODEL) -> str:
    """Directory of the built-in model ``name`` (Hugging Face format: config, safetensors weights, tokenizer).

    ``FileNotFoundError`` naming the command that builds it when its files are not there.
    """
    model = get_builtin_model(name)
    if not model.available:
        raise FileNotFoundError(
            f"the built-in model {model.name!r} is missing from {model.path}; build it with `{model.build_command}`"
        )
    return model.path


def builtin_training_length(name: str = DEFAULT_MODEL) -> int:
    """Longest sequence, in tokens, the built-in model ``name`` was trained on (from its ``training_log.json``)."""
    with open(os.path.join(builtin_model_path(name), "training_log.json")) as fh:
        config = json.load(fh)["config"]
    if "context_lengths" in config:  # fine-tuned with a press in the loop (training/finetune.py)
        return max(config["context_lengths"])
    return max(config["lengths"] + config.get("extend_lengths", []))


def builtin_model_name(model) -> Optional[str]:
    """The name of the built-in model a loaded ``model`` was loaded from, or None."""
    path = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)
    if not path or not os.path.isdir(path):
        return None
    for entry in BUILTIN_MODELS.values():
        if entry.available and os.path.samefile(path, entry.path):
            return entry.name
    return None


def is_builtin_model(model) -> bool:
    """Whether ``model`` (a loaded model) was loaded from one of the built-in models' directories."""
    return builtin_model_name(model) is not None


@contextmanager
def quiet_loading():
    """Hide transformers' "Loading weights" progress bar (restored afterwards): the built-in models load in well
    under a second, and the bar fills notebook outputs."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load_builtin_model(device: str = "cpu", dtype=None, name: str = DEFAULT_MODEL):
    """``(model, tokenizer)`` of the built-in model ``name``, loaded offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = builtin_model_path(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    return model.to(device).eval(), tokenizer
