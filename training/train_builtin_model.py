"""Train the built-in retrieval model: a small Llama that reads the evaluation tasks' English-like text.

    python -m kvpress_phase.training.train_builtin_model --output-dir kvpress_phase/builtin_model

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
cosine runs over ``--base-steps``. The loop, checkpoints and export are those of :mod:`.loop`, which
``kvpress-phase train`` (:mod:`.finetune`) shares: checkpoints (model, optimizer, schedule, curriculum, log) are
written every ``--checkpoint-every`` steps to ``--checkpoint-dir``; rerunning the same command resumes.
Batches are a pure function of (seed, step), so a resumed run sees the data an uninterrupted run would.
At the end the model is saved in the Hugging Face format with its tokenizer, and the loss curve as a PNG.
"""

from __future__ import annotations

import argparse
import math
import random
from collections import deque
from dataclasses import asdict, dataclass, field

import torch

from .loop import (
    adamw,
    answer_exact_match,
    cosine_lr,
    export_model,
    load_checkpoint,
    new_state,
    plot_loss,  # noqa: F401  (re-exported)
    run_training,
    token_accuracy,
)

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


def stage_length(config: TrainConfig, stage: int, step: int) -> int:
    """Context length of a step: the stage's length, except in the last stage, which cycles through the lengths
    from the third-longest up, so shorter contexts keep being trained while the longest is learned."""
    if stage < len(config.lengths) - 1:
        return config.lengths[stage]
    tail = config.lengths[-3:]
    return tail[step % len(tail)]


def lr_at(step: int, config: TrainConfig) -> float:
    """Two cosine cycles: the curriculum's (horizon ``base_steps``), then a warm restart for the extension."""
    if step < config.extend_from:
        return cosine_lr(step, config.base_steps, config.warmup, config.lr, config.min_lr)
    return cosine_lr(step - config.extend_from, config.steps - config.extend_from, config.extend_warmup,
                   config.extend_lr, config.extend_min_lr)


def step_plan(config: TrainConfig, stage: int, step: int) -> tuple[int, float, dict]:
    """Context length, copy fraction and task weights of a step: the curriculum stage's before ``extend_from``,
    the extension's (lengths cycled) from then on."""
    if step >= config.extend_from:
        lengths = config.extend_lengths
        return lengths[step % len(lengths)], config.extend_copy_fraction, config.extend_task_weights
    return stage_length(config, stage, step), config.copy_fraction[stage], config.task_weights


# ---------------------------------------------------------------------------------------------- loop
def train(config: TrainConfig, output_dir: str, checkpoint_dir: str, checkpoint_every: int = 200,
          progress: bool = True, threads: int | None = None, export_only: bool = False) -> None:
    """Train (or resume) the built-in model with the shared loop of :mod:`.loop`, then export it."""
    from kvpress_phase.evaluation.tokenizer import build_tokenizer

    if threads:
        torch.set_num_threads(threads)
    tokenizer = build_tokenizer()
    model = build_model(config, tokenizer)
    optimizer = adamw(model, config.lr, config.weight_decay)
    record = asdict(config)
    state = load_checkpoint(checkpoint_dir, record, model, optimizer)
    if export_only:
        if state is None:
            raise FileNotFoundError(f"no checkpoint to export in {checkpoint_dir}")
        export(model, tokenizer, state, config, output_dir)
        return
    if state is None:
        state = {**new_state(), "stage": 0}

    def step_fn(step: int, state: dict) -> dict:
        extending = step >= config.extend_from
        length, copy_fraction, task_weights = step_plan(config, state["stage"], step)
        input_ids, attention, labels, kinds = make_batch(tokenizer, config, step, length, copy_fraction,
                                                         task_weights)
        out = model(input_ids=input_ids, attention_mask=attention, labels=labels)
        out.loss.backward()
        logits = out.logits.detach()
        em_rows = answer_exact_match(logits, labels)
        task_rows = [i for i, k in enumerate(kinds) if k != "copy"]
        copy_rows = [i for i, k in enumerate(kinds) if k == "copy"]
        return {"loss": float(out.loss.detach()),
                "em": float(em_rows[task_rows].mean()) if task_rows else float("nan"),
                "copy_acc": float(token_accuracy(logits, labels)[copy_rows].mean()) if copy_rows else float("nan"),
                "length": length, "stage": len(config.lengths) if extending else state["stage"]}

    def after_step(state: dict, record: dict) -> None:
        # a copy-only stage advances on the copy token accuracy (the first repeated token is unpredictable, so
        # exact match cannot measure it); the others on the answers' exact match
        _, copy_fraction, _ = step_plan(config, state["stage"], record["step"])
        recent = deque(state.get("recent", []), maxlen=config.window)
        metric = record["copy_acc"] if copy_fraction >= 1.0 else record["em"]
        if not math.isnan(metric):
            recent.append(metric)
        extending = record["step"] >= config.extend_from
        stage_steps = sum(1 for h in state["history"] if h["stage"] == state["stage"])
        passed = len(recent) == config.window and sum(recent) / len(recent) >= config.advance_at
        last = state["stage"] + 1 >= len(config.lengths)
        if not extending and not last and (passed or stage_steps >= config.max_stage_steps[state["stage"]]):
            state["stage"] += 1
            recent.clear()
        state["recent"] = list(recent)

    def postfix(state: dict, record: dict) -> dict:
        recent = state["recent"]
        return {"loss": f"{record['loss']:.3f}", "em": f"{sum(recent) / max(1, len(recent)):.2f}",
                "length": record["length"]}

    state = run_training(model, optimizer, steps=config.steps, step_fn=step_fn, lr_fn=lambda s: lr_at(s, config),
                         config=record, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                         state=state, after_step=after_step, postfix=postfix, progress=progress)
    export(model, tokenizer, state, config, output_dir)


def export(model, tokenizer, state: dict, config: TrainConfig, output_dir: str) -> None:
    """Save the model, tokenizer, generation config, training log and loss curve."""
    from transformers import GenerationConfig

    from kvpress_phase.evaluation.tokenizer import save_tokenizer

    generation = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, do_sample=False)
    log = {"config": asdict(config), "n_parameters": sum(p.numel() for p in model.parameters()),
           "steps_done": state["step"], "history": state["history"]}
    export_model(model, tokenizer, output_dir, log, generation_config=generation, save_tokenizer=save_tokenizer,
                 plot_title="built-in model training (dotted: next stage, with its context lengths)")


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
