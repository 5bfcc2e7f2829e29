"""The training loop every trainer of this package runs: steps, schedule, checkpoints, progress, export.

Two trainers use it: :mod:`.train_builtin_model` (the built-in model, from scratch, with a curriculum) and
:mod:`.finetune` (fine-tuning any causal LM with a press in the loop, ``kvpress-phase train``). A trainer
supplies

* ``step_fn(step, state) -> dict``: build the step's data, run forward and backward (all micro-batches of the
  step), and return the step's metrics; ``"loss"`` is required, every value is logged in ``state["history"]``;
* ``lr_fn(step) -> float``: the learning rate of the step;
* optionally ``after_step(state, record)``, run once the optimizer has stepped and the record is logged (a
  curriculum advances here), and ``postfix(state, record) -> dict`` for the progress bar.

:func:`run_training` then owns the optimizer step (with gradient clipping), the wall clock, the progress bar and
the checkpoints. A checkpoint holds the trainer's configuration, the trainable weights, the optimizer, the
loop state (step, history and whatever the trainer keeps there) and the torch random state; it is written
atomically every ``checkpoint_every`` steps and at the end. Rerunning with the same configuration resumes from
it; a checkpoint written with another configuration is refused. Trainers make each step's data a pure function
of (seed, step), so a resumed run sees exactly the data an uninterrupted run would and logs the same losses.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Callable, Optional

import torch

CHECKPOINT_NAME = "checkpoint.pt"


# ---------------------------------------------------------------------------------------------- schedule
def cosine_lr(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    """Linear warm-up over ``warmup`` steps to ``peak``, then cosine decay to ``floor`` at step ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay on the trainable matrices only: decaying norm gains would cap how sharp attention can get."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in named if not (p.dim() >= 2 and "embed" not in n)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def adamw(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """The optimizer of both trainers: AdamW with betas (0.9, 0.98) over :func:`parameter_groups`."""
    return torch.optim.AdamW(parameter_groups(model, weight_decay), lr=lr, betas=(0.9, 0.98))


# ---------------------------------------------------------------------------------------------- metrics
def token_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row: share of supervised tokens that are the argmax prediction (teacher forcing)."""
    pred = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    mask = target != -100
    return ((pred == target) & mask).sum(1) / mask.sum(1).clamp(min=1)


def answer_exact_match(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row: 1.0 when every supervised token is the argmax prediction (teacher forcing)."""
    pred = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    mask = target != -100
    ok = (pred == target) | ~mask
    return ok.all(dim=1).float()


# ---------------------------------------------------------------------------------------------- checkpoints
def trainable_state(model) -> dict:
    """The weights a checkpoint must hold: the whole state dict when every parameter trains, else only the
    trainable parameters (a LoRA adapter, not the frozen base model)."""
    state = model.state_dict()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if all(p.requires_grad for p in model.parameters()):
        return state
    return {k: v for k, v in state.items() if k in trainable}


def load_trainable_state(model, weights: dict) -> None:
    """Load what :func:`trainable_state` saved; every saved tensor must find its parameter."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected:
        raise ValueError(f"the checkpoint holds weights this model does not have: {unexpected[:3]}")
    if all(p.requires_grad for p in model.parameters()) and missing:
        raise ValueError(f"the checkpoint lacks weights of this model: {missing[:3]}")


def checkpoint_path(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, CHECKPOINT_NAME)


def load_checkpoint(checkpoint_dir: str, config: dict, model, optimizer) -> Optional[dict]:
    """Restore model, optimizer and torch random state from ``checkpoint_dir``; return the loop state, or None
    when there is no checkpoint. ValueError when the checkpoint was written with another configuration."""
    path = checkpoint_path(checkpoint_dir)
    if not os.path.exists(path):
        return None
    ckpt = torch.load(path, weights_only=False, map_location="cpu")
    if ckpt["config"] != config:
        changed = sorted(k for k in set(config) | set(ckpt["config"]) if config.get(k) != ckpt["config"].get(k))
        raise ValueError(f"{path} was written with another training configuration (differs in "
                         f"{', '.join(changed[:5])}); use another --checkpoint-dir or the same arguments")
    load_trainable_state(model, ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(ckpt["torch_rng"])
    if ckpt.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ckpt["cuda_rng"])
    return ckpt["state"]


def save_checkpoint(checkpoint_dir: str, config: dict, model, optimizer, state: dict) -> None:
    """Write the checkpoint atomically (a crash mid-write leaves the previous one intact)."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = checkpoint_path(checkpoint_dir)
    tmp = path + ".tmp"
    torch.save({"config": config, "model": trainable_state(model), "optimizer": optimizer.state_dict(),
                "state": state, "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}, tmp)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- loop
def new_state() -> dict:
    return {"step": 0, "history": [], "elapsed": 0.0}


def _default_postfix(state: dict, record: dict) -> dict:
    out = {"loss": f"{record['loss']:.3f}"}
    if "acc" in record and not math.isnan(record["acc"]):
        out["acc"] = f"{record['acc']:.2f}"
    return out


def run_training(
    model,
    optimizer,
    *,
    steps: int,
    step_fn: Callable[[int, dict], dict],
    lr_fn: Callable[[int], float],
    config: dict,
    checkpoint_dir: str,
    checkpoint_every: int = 200,
    state: Optional[dict] = None,
    after_step: Optional[Callable[[dict, dict], None]] = None,
    postfix: Optional[Callable[[dict, dict], dict]] = None,
    clip: float = 1.0,
    progress: bool = True,
    desc: str = "train",
    stop_after_s: Optional[float] = None,
) -> dict:
    """Train until ``state["step"] == steps``; return the loop state.

    ``state`` is the state restored from a checkpoint (see :func:`load_checkpoint`), or None for a fresh run.
    ``config`` (a JSON-able dict) is stored with every checkpoint and must match on resume. With
    ``stop_after_s`` the loop checkpoints and returns early once this call has run that many seconds (the
    returned ``state["step"]`` is then below ``steps``; calling again resumes), so a long run can be cut into
    slices of bounded length.
    """
    from tqdm.auto import tqdm

    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    state = new_state() if state is None else state
    params = [p for p in model.parameters() if p.requires_grad]
    postfix = postfix or _default_postfix
    model.train()
    bar = tqdm(total=steps, initial=state["step"], disable=not progress, desc=desc, unit="step")
    start = time.time() - state["elapsed"]
    call_start = time.time()
    try:
        while state["step"] < steps:
            step = state["step"]
            lr = lr_fn(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            metrics = step_fn(step, state)
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            state["step"] += 1
            state["elapsed"] = time.time() - start
            record = {"step": step, **metrics, "lr": lr, "time": state["elapsed"]}
            state["history"].append(record)
            if after_step is not None:
                after_step(state, record)
            bar.set_postfix(postfix(state, record))
            bar.update(1)
            if state["step"] % checkpoint_every == 0 or state["step"] == steps:
                save_checkpoint(checkpoint_dir, config, model, optimizer, state)
            elif stop_after_s is not None and time.time() - call_start >= stop_after_s:
                save_checkpoint(checkpoint_dir, config, model, optimizer, state)
                break
    finally:
        bar.close()
    return state


# ---------------------------------------------------------------------------------------------- export
def export_model(model, tokenizer, output_dir: str, log: dict, generation_config=None,
                 save_tokenizer: Optional[Callable] = None, plot_title: str = "training") -> None:
    """Save ``model`` (safetensors) and ``tokenizer`` in the Hugging Face format, ``log`` as
    ``training_log.json`` and the loss curve of ``log["history"]`` as ``loss_curve.png``.

    ``generation_config`` replaces the model's own when given; ``save_tokenizer(tokenizer, directory)`` replaces
    ``tokenizer.save_pretrained(directory)`` when given."""
    os.makedirs(output_dir, exist_ok=True)
    model.eval()
    model.save_pretrained(output_dir, safe_serialization=True)
    if generation_config is not None:
        generation_config.save_pretrained(output_dir)
    if save_tokenizer is None:
        tokenizer.save_pretrained(output_dir)
    else:
        save_tokenizer(tokenizer, output_dir)
    with open(os.path.join(output_dir, "training_log.json"), "w") as fh:
        json.dump(log, fh)
    if log.get("history"):
        plot_loss(log["history"], os.path.join(output_dir, "loss_curve.png"), title=plot_title)


def plot_loss(history: list[dict], path: str, title: str = "training") -> None:
    """Loss (25-step mean, log scale) and answer exact match against the step; dotted lines where ``stage``
    changes, when the history has stages."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    df = pd.DataFrame(history)
    acc = "em" if "em" in df else "acc"
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(df["step"], df["loss"].rolling(25, min_periods=1).mean(), label="loss (25-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("answer-token loss")
    ax.set_yscale("log")
    if acc in df:
        ax2 = ax.twinx()
        ax2.plot(df["step"], df[acc].rolling(25, min_periods=1).mean(), color="tab:green", alpha=0.7,
                 label="answer exact match")
        ax2.set_ylabel("exact match (teacher forced)")
        ax2.set_ylim(0, 1)
    if "stage" in df:
        for change in df.index[df["stage"].diff().fillna(0) != 0]:
            row = df.loc[change]
            lengths = sorted(df.loc[df["stage"] == row["stage"], "length"].unique())
            ax.axvline(row["step"], color="grey", linestyle=":", linewidth=0.8)
            ax.text(row["step"], ax.get_ylim()[1], " " + "/".join(map(str, lengths)), fontsize=7, va="top",
                    rotation=90)
    fig.legend(loc="lower left", fontsize=8, bbox_to_anchor=(0.1, 0.12))
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
