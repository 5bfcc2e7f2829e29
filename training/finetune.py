"""Compression-aware fine-tuning: train a causal LM with one of our presses in the loop (``kvpress-phase train``).

    kvpress-phase train --recipe chunked --output-dir kvpress_phase/builtin_model_chunked
    kvpress-phase train --model path/or/hub-id --press chunked_stride --ratios 0.5 --strides 8 --steps 500 \\
        --output-dir outputs/my-model

Every training example is one context, one question and its answer, laid out as kvpress's pipeline lays them
out (:func:`~kvpress_phase.evaluation.tasks.training_sequence`). A step

1. prefills the contexts under the press, ``with press(model): model.model(context_ids, past_key_values=cache)``:
   kvpress's forward hook compresses every layer's keys and values once the layer has run and writes the
   result into the cache. Nothing on that path is under ``torch.no_grad`` (kvpress's hook is a plain forward
   hook, our presses' pooling is differentiable PyTorch, and the cache stores the tensors it is given), so the
   compressed cache stays attached to the graph of the prefill;
2. runs the question and the answer (teacher forcing) on the compressed cache with position ids continuing from
   the original context length, exactly as the pipeline decodes (the cache positions, hence the causal mask,
   count the compressed entries; the rotary positions do not);
3. takes the cross-entropy on the answer tokens and EOS only and backpropagates: through the attention on the
   compressed entries, the pooling (and its un-rotation and re-rotation of keys), and the prefill of every
   layer, down to the embeddings.

Contexts of one forward pass must have the same length, so that they compress to the same cache length: the
task generators hit the requested length exactly; rows of a user dataset are grouped by their context length,
and each group is a forward pass of its own. The loss of a step is the sum over all its answer tokens divided
by their number, whatever the grouping and the gradient accumulation, so both leave the gradient unchanged.

Per micro-batch (``grad_accum`` of them per optimizer step) the press is drawn: with probability
``uncompressed_fraction`` no compression; otherwise a ratio (from ``ratios``, or uniform in ``ratio_range``),
a stride from ``strides``, and a grid offset, ``offset`` (``offset_mode="fixed"``) or uniform in
``[0, stride)`` (``"random"``). With ``curriculum_steps`` the largest ratio that may be drawn grows linearly from
the smallest to the largest over that many steps. Each example's task (weights ``tasks``, plus ``dataset_weight``
for rows of ``dataset``) and each micro-batch's context length are drawn too. Every draw comes from a generator
seeded by (seed, step, micro-batch[, example]), so the data and presses of a step are a pure function of the
configuration and the step: a resumed run is the uninterrupted run.

The loop, checkpoints, progress bar and export are :mod:`.loop`'s, shared with the built-in model's
trainer (:mod:`.train_builtin_model`). On CUDA, ``dtype="bfloat16"`` (the default there) runs forward and backward
under bfloat16 autocast with float32 master weights; with LoRA (``lora=True``, through ``peft``) the frozen base
model is loaded in bfloat16 and the adapters train in float32, and the exported model has the adapters merged
(the adapter alone is saved in ``<output_dir>/adapter``).
"""

from __future__ import annotations

import os
from typing import Optional

from kvpress_phase.evaluation.arguments import resolve_device

from .config import DEFAULT_TASKS, RECIPES, FinetuneConfig, check_run_settings
from .data import ExampleSource
from .models import apply_lora, base_model, export_finetuned, load_model, load_tokenizer, resolve_dtype, resolve_model
from .step import train_step


def finetune(config: FinetuneConfig, output_dir: str, checkpoint_dir: Optional[str] = None, *,
             checkpoint_every: int = 100, progress: bool = True, device: str = "auto", threads: Optional[int] = None,
             model=None, tokenizer=None, command: Optional[str] = None, max_minutes: Optional[float] = None) -> dict:
    """Fine-tune (or resume) ``config`` and export the model to ``output_dir``; return the training log.

    ``model``/``tokenizer`` train those objects instead of loading ``config.model`` (which then only labels the
    run). ``checkpoint_dir`` defaults to ``checkpoints/<name of output_dir>``; rerunning with the same
    configuration and checkpoint directory resumes. ``command`` (the command line) is kept in the log. With
    ``max_minutes`` the call checkpoints and returns once it has trained that long; the log then has
    ``steps_done < config.steps``, nothing is exported, and calling again resumes.
    """
    import contextlib

    import torch

    from .loop import adamw, cosine_lr, load_checkpoint, run_training

    config.validate()
    check_run_settings(checkpoint_every, max_minutes)
    device = resolve_device(device)
    dtype = resolve_dtype(config.dtype, device)
    if threads:
        torch.set_num_threads(threads)
    checkpoint_dir = checkpoint_dir or os.path.join("checkpoints", os.path.basename(os.path.normpath(output_dir)))
    builtin = False
    if model is None:
        path, builtin = resolve_model(config)
        tokenizer = load_tokenizer(config, path)
    elif tokenizer is None:
        raise ValueError("a model object needs its tokenizer")
    from kvpress_phase.evaluation.prompting import check_tokenizer

    check_tokenizer(tokenizer)  # the pipeline layout the examples follow needs a fast tokenizer with BOS or template
    source = ExampleSource(config, tokenizer)
    source.check()  # bad data settings fail before the model is loaded
    if model is None:
        model = load_model(config, path, device)
    if config.lora:
        model = apply_lora(model, config)
    model.to(device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if dtype == "bfloat16":
        autocast = lambda: torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)  # noqa: E731
    else:
        autocast = contextlib.nullcontext
    optimizer = adamw(model, config.lr, config.weight_decay)
    record = config.checkpoint_record()
    state = load_checkpoint(checkpoint_dir, record, model, optimizer)

    def step_fn(step: int, state: dict) -> dict:
        return train_step(model, config, source, step, pad_id, autocast)

    def postfix(state: dict, record: dict) -> dict:
        recent = state["history"][-50:]
        return {"loss": f"{record['loss']:.3f}", "acc": f"{sum(h['acc'] for h in recent) / len(recent):.2f}",
                "ratio": "/".join(f"{r:g}" for r in record["ratios"]),
                "stride": "/".join(map(str, record["strides"]))}

    state = run_training(model, optimizer, steps=config.steps, step_fn=step_fn,
                         lr_fn=lambda s: cosine_lr(s, config.steps, config.warmup, config.lr, config.min_lr),
                         config=record, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                         state=state, postfix=postfix, clip=config.clip, progress=progress, desc="train",
                         stop_after_s=None if max_minutes is None else 60 * max_minutes)
    log = {"config": record, "trainer": "kvpress_phase.training.finetune", "command": command,
           "device": device, "dtype": dtype, "n_parameters": sum(p.numel() for p in base_model(model).parameters()),
           "n_trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "steps_done": state["step"], "history": state["history"]}
    if state["step"] == config.steps:
        export_finetuned(model, tokenizer, output_dir, log, builtin)
    return log


__all__ = ["FinetuneConfig", "RECIPES", "DEFAULT_TASKS", "finetune"]
