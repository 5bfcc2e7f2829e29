"""The model a fine-tuning run trains: loading it and its tokenizer, LoRA adapters, the dtype, and the export."""

from __future__ import annotations

import os

from kvpress_phase.evaluation.arguments import first_line

from .config import FinetuneConfig


def resolve_model(config: FinetuneConfig) -> tuple[str, bool]:
    """``(path or hub id, whether it is one of the small built-in models)`` of ``config.model`` (a registered
    name, including ``smollm2``, a ``.gguf`` file, a folder or a hub id: :func:`kvpress_phase.builtin.model_path`,
    as ``kvpress-phase eval`` resolves it); ValueError when a built-in model is not built, the real model cannot be
    fetched, a folder lacks files or a name is unknown."""
    from kvpress_phase.builtin import BUILTIN_MODELS, DEFAULT_MODEL, BuiltinModel, model_path

    name = config.model or DEFAULT_MODEL
    try:  # smollm2 is fetched and converted on first use (ModelUnavailable, a ValueError, when it cannot be)
        return model_path(name), isinstance(BUILTIN_MODELS.get(name), BuiltinModel)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None


def load_tokenizer(config: FinetuneConfig, path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model {config.model or path!r} cannot be loaded: {first_line(exc)}") from None


def load_model(config: FinetuneConfig, path: str, device: str):
    """The causal LM to train: float32, or bfloat16 for the frozen base of a LoRA run in bfloat16."""
    import torch
    from transformers import AutoModelForCausalLM

    lora_bf16 = config.lora and resolve_dtype(config.dtype, device) == "bfloat16"
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if lora_bf16 else torch.float32)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model {config.model or path!r} cannot be loaded: {first_line(exc)}") from None


def apply_lora(model, config: FinetuneConfig):
    """``model`` wrapped with LoRA adapters (``peft``); only the adapters train."""
    import torch

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ValueError("lora needs the peft package (pip install peft)") from None
    present = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    absent = [t for t in config.lora_targets if t not in present]
    if absent:
        raise ValueError(f"lora_targets {absent} are not linear layers of this model (it has {sorted(present)})")
    torch.manual_seed(config.seed)
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=list(config.lora_targets), task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return dtype


def base_model(model):
    """The transformers model under a peft wrapper (the model itself otherwise): kvpress hooks its layers."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def export_finetuned(model, tokenizer, output_dir: str, log: dict, builtin: bool) -> None:
    """Export a plain transformers model (LoRA adapters merged; the adapter alone in ``adapter/``)."""
    from kvpress_phase.evaluation.tokenizer import save_tokenizer
    from .loop import export_model

    if hasattr(model, "merge_and_unload"):
        model.save_pretrained(os.path.join(output_dir, "adapter"))
        model = model.merge_and_unload()
    export_model(model, tokenizer, output_dir, log, save_tokenizer=save_tokenizer if builtin else None,
                 plot_title="compression-aware fine-tuning")
