"""Train the built-in retrieval model: a small Llama that reads the evaluation tasks' English-like text.

    python -m kvpress_phase.evaluation.train_builtin_model --output-dir kvpress_phase/builtin_model

Data come from the same task generators the evaluation suite uses (``training_example``, whose seeds live in a
domain disjoint from every evaluation seed), mixed with a copy objective: a random segment drawn from a small
random vocabulary, random filler of random length, then the segment again, with the loss on the repeat. The
repeat's offset is random, so only matching content over several tokens predicts it; this is what teaches the
model to retrieve before the needle tasks can be learned.

The curriculum is a list of stages (``--lengths``, ``--copy-fraction``, ``--max-stage-steps``): the first is
copy-only at 128 tokens, because the copy skill forms within a few thousand steps alone but not when mixed with
the tasks from the start; later stages mix the tasks in at growing lengths. A stage ends when the metric of the
last ``--window`` batches passes ``--advance-at`` (copy token accuracy in a copy-only stage, the answers' exact
match otherwise) or after its maximum number of steps; the last stage cycles through the three longest lengths.
From step ``--extend-from`` on, an extension phase trains on ``--extend-lengths`` in turn with its own task mix
(more weight on what the curriculum leaves weakest) and a warm-restarted cosine schedule; the curriculum's own
cosine runs over ``--base-steps``. Checkpoints (model, optimizer, schedule, curriculum,
log) are written every ``--checkpoint-every`` steps to ``--checkpoint-dir``; rerunning the same command resumes.
Batches are a pure function of (seed, step), so a resumed run sees the data an uninterrupted run would.
At the end the model is saved in the Hugging Face format with its tokenizer, and the loss curve as a PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import torch

TASK_WEIGHTS = {
    "niah_single": 2.0,
    "niah_multikey": 2.0,
    "niah_multivalue": 1.0,
    "niah_multiquery": 1.0,
    "vt": 1.0,
    "qa_single_doc": 1.0,
    "qa_multi_doc": 1.0,
    "passage_retrieval": 1.0,
    "passage_count": 0.5,
}
"""Task mix of the curriculum stages."""

EXTEND_TASK_WEIGHTS = {
    "niah_single": 1.0,
    "niah_multikey": 1.0,
    "niah_multivalue": 2.0,
    "niah_multiquery": 1.5,
    "vt": 1.0,
    "qa_single_doc": 2.0,
    "qa_multi_doc": 2.0,
    "passage_retrieval": 2.0,
    "passage_count": 0.0,
}
"""Task mix of the extension: more weight on what the curriculum leaves weakest; counting is dropped (it is not
retrieval, and the built-in model is not meant for it)."""


@dataclass
class TrainConfig:
    seed: int = 0
    steps: int = 8800
    batch_tokens: int = 8192
    max_batch: int = 16
    lengths: list = field(default_factory=lambda: [128, 128, 256, 512, 1024, 2048])
    copy_fraction: list = field(default_factory=lambda: [1.0, 0.3, 0.2, 0.2, 0.2, 0.2])
    max_stage_steps: list = field(default_factory=lambda: [3000, 800, 800, 800, 800, 10**9])
    advance_at: float = 0.9
    window: int = 50
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 100
    base_steps: int = 7000
    extend_from: int = 5800
    extend_lengths: list = field(default_factory=lambda: [1024, 2048])
    extend_copy_fraction: float = 0.1
    extend_lr: float = 5e-4
    extend_min_lr: float = 5e-5
    extend_warmup: int = 50
    weight_decay: float = 0.05
    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 512
    rope_theta: float = 10000.0
    task_weights: dict = field(default_factory=lambda: dict(TASK_WEIGHTS))
    extend_task_weights: dict = field(default_factory=lambda: dict(EXTEND_TASK_WEIGHTS))

    def __post_init__(self):
        n = len(self.lengths)
        if not (len(self.copy_fraction) == len(self.max_stage_steps) == n):
            raise ValueError(f"lengths, copy_fraction and max_stage_steps need one value per stage; got {n}, "
                             f"{len(self.copy_fraction)} and {len(self.max_stage_steps)}")
        if not 0 < self.extend_from:
            raise ValueError(f"extend_from must be positive, got {self.extend_from}")
        if self.base_steps < 1 or self.steps < 1:
            raise ValueError(f"steps and base_steps must be positive, got {self.steps} and {self.base_steps}")
        if not self.extend_lengths:
            raise ValueError("extend_lengths must hold at least one length")
        for name in ("task_weights", "extend_task_weights"):
            weights = getattr(self, name)
            if any(w < 0 for w in weights.values()) or not sum(weights.values()) > 0:
                raise ValueError(f"{name} must be non-negative with a positive sum, got {weights}")


# ---------------------------------------------------------------------------------------------- data
def copy_example(tokenizer, rng: random.Random, length: int) -> dict:
    """BOS, a segment, filler, the same segment again; the loss is on the repeated segment and EOS."""
    from kvpress_phase.evaluation.tokenizer import SPECIAL_TOKENS

    specials = {tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    ids = [i for i in range(len(tokenizer)) if i not in specials]
    vocab = rng.sample(ids, rng.randint(4, min(512, len(ids))))
    seg_len = rng.randint(8, max(8, length // 3))
    segment = [rng.choice(vocab) for _ in range(seg_len)]
    filler = [rng.choice(ids) for _ in range(rng.randint(0, max(0, length - 2 * seg_len - 2)))]
    input_ids = [tokenizer.bos_token_id] + segment + filler + segment + [tokenizer.eos_token_id]
    loss_mask = [0] * (1 + seg_len + len(filler)) + [1] * (seg_len + 1)
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def make_batch(tokenizer, config: TrainConfig, step: int, length: int, copy_fraction: float = 0.5,
               task_weights: dict | None = None):
    """The batch of ``step``: a pure function of (seed, step, length, copy fraction, task weights)."""
    from kvpress_phase.evaluation.tasks import training_example

    task_weights = config.task_weights if task_weights is None else task_weights
    rng = random.Random(f"{config.seed}/{step}")
    names = list(task_weights) + ["copy"]
    task_total = sum(task_weights.values())
    weights = [w * (1 - copy_fraction) / task_total for w in task_weights.values()] + [copy_fraction]
    size = max(1, min(config.max_batch, config.batch_tokens // length))
    examples, kinds = [], []
    for i in range(size):
        task = rng.choices(names, weights)[0]
        sub = random.Random(f"{config.seed}/{step}/{i}")
        ex = None
        if task != "copy":
            try:
                ex = training_example(task, tokenizer, sub, context_length=length)
            except ValueError:  # the task does not fit this short a context: a copy example instead
                task = "copy"
        if ex is None:
            ex = copy_example(tokenizer, sub, length)
        examples.append(ex)
        kinds.append(task)
    width = max(len(e["input_ids"]) for e in examples)
    pad = tokenizer.pad_token_id
    input_ids = torch.full((size, width), pad, dtype=torch.long)
    labels = torch.full((size, width), -100, dtype=torch.long)
    attention = torch.zeros((size, width), dtype=torch.long)
    for row, ex in enumerate(examples):
        n = len(ex["input_ids"])
        ids = torch.tensor(ex["input_ids"])
        input_ids[row, :n] = ids
        attention[row, :n] = 1
        mask = torch.tensor(ex["loss_mask"], dtype=torch.bool)
        labels[row, :n] = torch.where(mask, ids, torch.full_like(ids, -100))
    return input_ids, attention, labels, kinds


# ---------------------------------------------------------------------------------------------- model
def build_model(config: TrainConfig, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=4096,
        rope_theta=config.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(config.seed)
    return LlamaForCausalLM(model_config)


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay on the matrices only: decaying norm gains would cap how sharp attention can get."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def stage_length(config: TrainConfig, stage: int, step: int) -> int:
    """Context length of a step: the stage's length, except in the last stage, which cycles through the lengths
    from the third-longest up, so shorter contexts keep being trained while the longest is learned."""
    if stage < len(config.lengths) - 1:
        return config.lengths[stage]
    tail = config.lengths[-3:]
    return tail[step % len(tail)]


def _cosine(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


def lr_at(step: int, config: TrainConfig) -> float:
    """Two cosine cycles: the curriculum's (horizon ``base_steps``), then a warm restart for the extension."""
    if step < config.extend_from:
        return _cosine(step, config.base_steps, config.warmup, config.lr, config.min_lr)
    return _cosine(step - config.extend_from, config.steps - config.extend_from, config.extend_warmup,
                   config.extend_lr, config.extend_min_lr)


def step_plan(config: TrainConfig, stage: int, step: int) -> tuple[int, float, dict]:
    """Context length, copy fraction and task weights of a step: the curriculum stage's before ``extend_from``,
    the extension's (lengths cycled) from then on."""
    if step >= config.extend_from:
        lengths = config.extend_lengths
        return lengths[step % len(lengths)], config.extend_copy_fraction, config.extend_task_weights
    return stage_length(config, stage, step), config.copy_fraction[stage], config.task_weights


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


# ---------------------------------------------------------------------------------------------- loop
def train(config: TrainConfig, output_dir: str, checkpoint_dir: str, checkpoint_every: int = 200,
          progress: bool = True, threads: int | None = None, export_only: bool = False) -> None:
    from tqdm.auto import tqdm

    from kvpress_phase.evaluation.tokenizer import build_tokenizer

    if threads:
        torch.set_num_threads(threads)
    tokenizer = build_tokenizer()
    model = build_model(config, tokenizer)
    optimizer = torch.optim.AdamW(parameter_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.98))
    state = {"step": 0, "stage": 0, "history": [], "elapsed": 0.0}
    os.makedirs(checkpoint_dir, exist_ok=True)
    ckpt_path = os.path.join(checkpoint_dir, "checkpoint.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, weights_only=False)
        if ckpt["config"] != asdict(config):
            raise ValueError(f"{ckpt_path} was written with another training configuration; "
                             "use another --checkpoint-dir or the same arguments")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        state = ckpt["state"]
        torch.set_rng_state(ckpt["torch_rng"])
    if export_only:
        if not os.path.exists(ckpt_path):
            raise FileNotFoundError(f"no checkpoint to export in {checkpoint_dir}")
        export(model, tokenizer, state, config, output_dir)
        return
    recent = deque(state.get("recent", []), maxlen=config.window)

    def save():
        tmp = ckpt_path + ".tmp"
        torch.save({"config": asdict(config), "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "state": state, "torch_rng": torch.get_rng_state()}, tmp)
        os.replace(tmp, ckpt_path)

    model.train()
    bar = tqdm(total=config.steps, initial=state["step"], disable=not progress, desc="train", unit="step")
    start = time.time() - state["elapsed"]
    while state["step"] < config.steps:
        step = state["step"]
        extending = step >= config.extend_from
        length, copy_fraction, task_weights = step_plan(config, state["stage"], step)
        input_ids, attention, labels, kinds = make_batch(tokenizer, config, step, length, copy_fraction,
                                                         task_weights)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        out = model(input_ids=input_ids, attention_mask=attention, labels=labels)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        em_rows = answer_exact_match(out.logits.detach(), labels)
        task_rows = [i for i, k in enumerate(kinds) if k != "copy"]
        em = float(em_rows[task_rows].mean()) if task_rows else float("nan")
        copy_rows = [i for i, k in enumerate(kinds) if k == "copy"]
        copy_acc = float(token_accuracy(out.logits.detach(), labels)[copy_rows].mean()) if copy_rows else float("nan")
        # a copy-only stage advances on the copy token accuracy (the first repeated token is unpredictable, so
        # exact match cannot measure it); the others on the answers' exact match
        progress_metric = copy_acc if copy_fraction >= 1.0 else em
        state["step"] += 1
        state["elapsed"] = time.time() - start
        state["history"].append({"step": step, "loss": float(out.loss.detach()), "em": em, "copy_acc": copy_acc,
                                 "length": length, "stage": len(config.lengths) if extending else state["stage"],
                                 "lr": lr_at(step, config), "time": state["elapsed"]})
        if not math.isnan(progress_metric):
            recent.append(progress_metric)
        stage_steps = sum(1 for h in state["history"] if h["stage"] == state["stage"])
        passed = len(recent) == config.window and sum(recent) / len(recent) >= config.advance_at
        last = state["stage"] + 1 >= len(config.lengths)
        if not extending and not last and (passed or stage_steps >= config.max_stage_steps[state["stage"]]):
            state["stage"] += 1
            recent.clear()
        state["recent"] = list(recent)
        bar.set_postfix(loss=f"{float(out.loss.detach()):.3f}", em=f"{(sum(recent) / max(1, len(recent))):.2f}",
                        length=length)
        bar.update(1)
        if state["step"] % checkpoint_every == 0 or state["step"] == config.steps:
            save()
    bar.close()
    export(model, tokenizer, state, config, output_dir)


def export(model, tokenizer, state: dict, config: TrainConfig, output_dir: str) -> None:
    """Save the model, tokenizer, generation config, training log and loss curve."""
    from transformers import GenerationConfig

    from kvpress_phase.evaluation.tokenizer import save_tokenizer

    os.makedirs(output_dir, exist_ok=True)
    model.eval()
    model.save_pretrained(output_dir, safe_serialization=True)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id, do_sample=False).save_pretrained(output_dir)
    save_tokenizer(tokenizer, output_dir)
    with open(os.path.join(output_dir, "training_log.json"), "w") as fh:
        json.dump({"config": asdict(config), "n_parameters": sum(p.numel() for p in model.parameters()),
                   "steps_done": state["step"], "history": state["history"]}, fh)
    plot_loss(state["history"], os.path.join(output_dir, "loss_curve.png"))


def plot_loss(history: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    df = pd.DataFrame(history)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(df["step"], df["loss"].rolling(25, min_periods=1).mean(), label="loss (25-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("answer-token loss")
    ax.set_yscale("log")
    ax2 = ax.twinx()
    ax2.plot(df["step"], df["em"].rolling(25, min_periods=1).mean(), color="tab:green", alpha=0.7,
             label="answer exact match")
    ax2.set_ylabel("exact match (teacher forced)")
    ax2.set_ylim(0, 1)
    for change in df.index[df["stage"].diff().fillna(0) != 0]:
        row = df.loc[change]
        lengths = sorted(df.loc[df["stage"] == row["stage"], "length"].unique())
        ax.axvline(row["step"], color="grey", linestyle=":", linewidth=0.8)
        ax.text(row["step"], ax.get_ylim()[1], " " + "/".join(map(str, lengths)), fontsize=7, va="top",
                rotation=90)
    fig.legend(loc="lower left", fontsize=8, bbox_to_anchor=(0.1, 0.12))
    ax.set_title("built-in model training (dotted: next stage, with its context lengths)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = TrainConfig()
    parser.add_argument("--output-dir", default="kvpress_phase/builtin_model")
    parser.add_argument("--checkpoint-dir", default="checkpoints/builtin_model")
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--export-only", action="store_true",
                        help="export the latest checkpoint of --checkpoint-dir as it is (training stopped early)")
    for name, value in asdict(defaults).items():
        if isinstance(value, dict):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, list):
            cast = type(value[0])
            parser.add_argument(flag, type=lambda s, cast=cast: [cast(x) for x in s.split(",")], default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    args = parser.parse_args(argv)
    try:
        config = TrainConfig(**{k: getattr(args, k) for k in asdict(defaults) if not k.endswith("task_weights")})
    except ValueError as exc:
        parser.error(str(exc))
    train(config, args.output_dir, args.checkpoint_dir, args.checkpoint_every, progress=not args.no_progress,
          threads=args.threads, export_only=args.export_only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
