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

import argparse
import os
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

from kvpress_phase.evaluation.arguments import csv_list, first_line, resolve_device

DEFAULT_TASKS = {"niah_single": 1.0, "niah_multikey": 1.0, "niah_multiquery": 1.0, "niah_multivalue": 1.0}
"""Task mix of the fine-tuning data by default (the retrieval tasks of the phase study and their siblings)."""

RECIPES: dict[str, dict] = {
    "chunked": dict(
        model="builtin", press="chunked_stride", ratios=[0.25, 0.5, 0.625, 0.75, 0.875], strides=[4, 8, 16],
        offset_mode="random", uncompressed_fraction=0.1, tasks=dict(DEFAULT_TASKS),
        context_lengths=[512, 1024, 2048], steps=2400, batch_size=8, grad_accum=1, lr=3e-4, min_lr=3e-5,
        warmup=50, weight_decay=0.0, seed=0,
    ),
}
"""Named configurations (``--recipe``). ``chunked`` builds the trained-in built-in model; ``chunked-fixed`` is
its control, the same recipe on a fixed grid (offset 0). ``docs/preregistration-training.md`` fixes both."""
RECIPES["chunked-fixed"] = {**RECIPES["chunked"], "offset_mode": "fixed", "offset": 0}

OFFSET_MODES = ("fixed", "random")
DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class FinetuneConfig:
    """Everything that determines a fine-tuning run (stored with its checkpoints and in its training log).

    Attributes
    ----------
    model : str or None
        A built-in model name (``"builtin"``, ``"chunked"``), a local directory or a hub id; None is the
        default built-in model.
    press : str
        Our press with optional settings, as ``kvpress-phase eval --presses`` takes them:
        ``chunked_stride`` or ``phase_aware``, e.g. ``chunked_stride:rope=center``. Its ratio, stride and
        offset are drawn per micro-batch; ``window`` is the stride.
    ratios : list of float
        Compression ratios drawn from (uniformly), each in [0, 1). Ignored when ``ratio_range`` is set.
    ratio_range : [low, high] or None
        Draw the ratio uniformly in ``[low, high]`` instead.
    strides : list of int
        Strides drawn from (uniformly).
    offset_mode : {"fixed", "random"}
        The grid offset: ``offset`` every time, or uniform in ``[0, stride)`` per micro-batch.
    offset : int
        The offset of ``offset_mode="fixed"``.
    curriculum_steps : int
        Over the first that many steps the largest ratio that may be drawn grows linearly from the smallest to
        the largest (0: no curriculum).
    uncompressed_fraction : float
        Share of micro-batches trained without compression.
    tasks : dict
        Task name -> weight of the generated data (names of ``kvpress-phase list``).
    dataset : str or None
        A dataset in kvpress's evaluation schema (``context``, ``question``, ``answer_prefix``, ``answer``;
        a ``save_to_disk`` folder or a ``.json``/``.jsonl``/``.parquet``/``.csv`` file). The training target
        is its ``completion`` column when there is one, else every reference of ``answer`` joined by ", ",
        which is correct under both of kvpress's scoring rules (all references, or any one).
    dataset_split : str
        Split of ``dataset`` to read.
    dataset_weight : float
        Weight of the dataset's rows in the example mix, beside the task weights.
    context_lengths : list of int
        Context lengths of the generated examples (one drawn per micro-batch).
    steps, batch_size, grad_accum : int
        Optimizer steps; examples per micro-batch; micro-batches per step.
    lr, min_lr, warmup, weight_decay, clip
        AdamW with linear warm-up to ``lr`` and cosine decay to ``min_lr``; weight decay on matrices only;
        gradient-norm clipping (0: none).
    seed : int
        Seeds the data, the press draws and the LoRA initialisation.
    dtype : {"auto", "float32", "bfloat16"}
        ``auto``: bfloat16 autocast on CUDA, float32 on the CPU.
    lora, lora_r, lora_alpha, lora_dropout, lora_targets
        Train LoRA adapters (``peft``) on the ``lora_targets`` linear layers instead of every weight.
    """

    model: Optional[str] = None
    press: str = "chunked_stride"
    ratios: list = field(default_factory=lambda: [0.5])
    ratio_range: Optional[list] = None
    strides: list = field(default_factory=lambda: [8])
    offset_mode: str = "random"
    offset: int = 0
    curriculum_steps: int = 0
    uncompressed_fraction: float = 0.0
    tasks: dict = field(default_factory=lambda: dict(DEFAULT_TASKS))
    dataset: Optional[str] = None
    dataset_split: str = "test"
    dataset_weight: float = 1.0
    context_lengths: list = field(default_factory=lambda: [512, 1024])
    steps: int = 1000
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup: int = 50
    weight_decay: float = 0.0
    clip: float = 1.0
    seed: int = 0
    dtype: str = "auto"
    lora: bool = False
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_targets: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    def __post_init__(self):
        self.validate()

    # -------------------------------------------------------------------------------- validation
    def validate(self) -> None:
        """ValueError naming the first invalid setting (checks that need no model or tokenizer)."""
        from kvpress_phase.evaluation.presses import OUR_PRESSES, parse_press_spec
        from kvpress_phase.evaluation.tasks import get_task

        keys = {item.partition("=")[0].strip() for item in str(self.press).split(":")[1:]}
        for key in ("compression_ratio", "stride", "offset", "window"):
            if key in keys:
                raise ValueError(f"press setting {key!r} is set by the trainer (ratios, strides, offset-mode), "
                                 f"not in --press")
        spec = parse_press_spec(self.press)
        if spec.name not in OUR_PRESSES:
            raise ValueError(f"press must be one of {', '.join(OUR_PRESSES)} (optionally with :key=value settings), "
                             f"got {self.press!r}")
        if dict(spec.options).get("backend") == "triton":
            raise ValueError("press backend 'triton' has no backward pass; training uses backend=torch")
        if self.ratio_range is not None:
            if len(self.ratio_range) != 2 or not 0 <= self.ratio_range[0] <= self.ratio_range[1] < 1:
                raise ValueError(f"ratio_range must be [low, high] with 0 <= low <= high < 1, got {self.ratio_range}")
        elif not self.ratios or any(isinstance(r, bool) or not 0 <= r < 1 for r in self.ratios):
            raise ValueError(f"ratios must be a non-empty list of numbers in [0, 1), got {self.ratios}")
        if not self.strides or any(not _is_int(s) or s < 1 for s in self.strides):
            raise ValueError(f"strides must be a non-empty list of integers >= 1, got {self.strides}")
        if self.offset_mode not in OFFSET_MODES:
            raise ValueError(f"offset_mode must be one of {OFFSET_MODES}, got {self.offset_mode!r}")
        if not _is_int(self.offset) or self.offset < 0:
            raise ValueError(f"offset must be an integer >= 0, got {self.offset!r}")
        for name in ("steps", "batch_size", "grad_accum"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not _is_int(self.curriculum_steps) or not 0 <= self.curriculum_steps <= self.steps:
            raise ValueError(f"curriculum_steps must be an integer in [0, steps={self.steps}], "
                             f"got {self.curriculum_steps!r}")
        if not 0 <= self.uncompressed_fraction <= 1:
            raise ValueError(f"uncompressed_fraction must be in [0, 1], got {self.uncompressed_fraction}")
        for task, weight in self.tasks.items():
            get_task(task)
            if not weight >= 0:
                raise ValueError(f"task weights must be >= 0, got {task}={weight}")
        if self.dataset is None and not sum(self.tasks.values()) > 0:
            raise ValueError("no training data: give tasks with a positive weight or a dataset")
        if self.dataset is not None and not self.dataset_weight >= 0:
            raise ValueError(f"dataset_weight must be >= 0, got {self.dataset_weight}")
        if self.dataset is not None and not (sum(self.tasks.values()) + self.dataset_weight) > 0:
            raise ValueError("no training data: the task weights and dataset_weight are all 0")
        if sum(self.tasks.values()) > 0 and (not self.context_lengths or
                                            any(not _is_int(n) or n < 64 for n in self.context_lengths)):
            raise ValueError(f"context_lengths must be a non-empty list of integers >= 64, got {self.context_lengths}")
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if not _is_int(self.warmup) or self.warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        if self.weight_decay < 0 or self.clip < 0:
            raise ValueError(f"weight_decay and clip must be >= 0, got {self.weight_decay} and {self.clip}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.lora and (not _is_int(self.lora_r) or self.lora_r < 1 or not self.lora_alpha > 0
                          or not 0 <= self.lora_dropout < 1 or not self.lora_targets):
            raise ValueError(f"LoRA needs lora_r >= 1, lora_alpha > 0, 0 <= lora_dropout < 1 and target modules; got "
                             f"r={self.lora_r}, alpha={self.lora_alpha}, dropout={self.lora_dropout}, "
                             f"targets={self.lora_targets}")
        for stride in self.strides:  # the press accepts every stride and both ends of the ratio range
            for ratio in self._ratio_bounds():
                self.build_press(ratio, stride, self.offset % stride)

    def _ratio_bounds(self) -> list[float]:
        return list(self.ratio_range) if self.ratio_range is not None else [min(self.ratios), max(self.ratios)]

    # -------------------------------------------------------------------------------- draws
    def build_press(self, ratio: float, stride: int, offset: int):
        """The press of one micro-batch (its kernels forced to the differentiable PyTorch backend)."""
        from kvpress_phase.evaluation.presses import PressSpec, build_press, parse_press_spec

        spec = parse_press_spec(self.press)
        options = dict(spec.options)
        options.setdefault("backend", "torch")
        return build_press(PressSpec(spec.name, tuple(options.items())), ratio, stride, None, offset)

    def ratio_cap(self, step: int) -> float:
        """The largest ratio that may be drawn at ``step`` (the curriculum's; the largest ratio without one)."""
        low, high = self._ratio_bounds()
        if self.curriculum_steps == 0:
            return high
        return low + (high - low) * min(1.0, (step + 1) / self.curriculum_steps)

    def draw_press(self, step: int, micro: int) -> dict:
        """``{"ratio", "stride", "offset"}`` of a micro-batch (ratio 0.0 when it trains uncompressed)."""
        rng = random.Random(f"{self.seed}/press/{step}/{micro}")
        stride = rng.choice(self.strides)
        # drawn in both modes, so that a fixed-grid run and a random-offset run with the same seed see the same
        # data, ratios, strides and uncompressed batches and differ in the offset alone
        random_offset = rng.randrange(stride)
        offset = random_offset if self.offset_mode == "random" else self.offset
        cap = self.ratio_cap(step)
        if self.ratio_range is not None:
            ratio = rng.uniform(self.ratio_range[0], cap)
        else:
            ratio = rng.choice([r for r in self.ratios if r <= cap + 1e-12])
        if rng.random() < self.uncompressed_fraction:
            ratio = 0.0
        return {"ratio": float(ratio), "stride": stride, "offset": offset}

    def checkpoint_record(self) -> dict:
        return asdict(self)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ------------------------------------------------------------------------------------------------ data
class ExampleSource:
    """Training examples of a configuration: generated task examples and rows of a user dataset."""

    def __init__(self, config: FinetuneConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.names = [t for t, w in config.tasks.items() if w > 0]
        self.weights = [config.tasks[t] for t in self.names]
        self.rows = None
        self._encoded: dict[int, dict] = {}
        if config.dataset is not None:
            self.rows = load_dataset_rows(config.dataset, config.dataset_split)
            if config.dataset_weight > 0:
                self.names.append("dataset")
                self.weights.append(config.dataset_weight)
        if not self.names:
            raise ValueError("no training data: every weight is 0")

    def check(self) -> None:
        """ValueError when a task cannot produce an example at one of the context lengths."""
        from kvpress_phase.evaluation.tasks import training_example

        for task in self.names:
            if task == "dataset":
                self.dataset_example(0)
                continue
            for length in self.config.context_lengths:
                try:
                    training_example(task, self.tokenizer, 0, context_length=length)
                except ValueError as exc:
                    raise ValueError(f"task {task!r} does not fit a context of {length} tokens: {exc}") from None

    def dataset_example(self, index: int) -> dict:
        from kvpress_phase.evaluation.tasks import training_sequence

        if index not in self._encoded:
            row = self.rows[index]
            completion = row.get("completion") or ", ".join(_as_list(row["answer"]))
            self._encoded[index] = training_sequence(self.tokenizer, row["context"], row["question"],
                                                     row.get("answer_prefix") or "", completion)
        return self._encoded[index]

    def micro_batch(self, step: int, micro: int) -> tuple[list[dict], list[str], int]:
        """Examples, their kinds (task names or ``"dataset"``) and the generated examples' context length."""
        from kvpress_phase.evaluation.tasks import training_example

        config = self.config
        lengths = config.context_lengths or [0]
        length = random.Random(f"{config.seed}/length/{step}/{micro}").choice(lengths)
        examples, kinds = [], []
        for i in range(config.batch_size):
            rng = random.Random(f"{config.seed}/data/{step}/{micro}/{i}")
            kind = rng.choices(self.names, self.weights)[0]
            if kind == "dataset":
                examples.append(self.dataset_example(rng.randrange(len(self.rows))))
            else:
                examples.append(training_example(kind, self.tokenizer, rng, context_length=length))
            kinds.append(kind)
        return examples, kinds, length


def _as_list(answer) -> list[str]:
    return [answer] if isinstance(answer, str) else [str(a) for a in answer]


def load_dataset_rows(path: str, split: str):
    """Rows of a user dataset in kvpress's schema; ValueError when it cannot be read or lacks a column."""
    from kvpress_phase.evaluation.tasks import load_hub_tasks

    if not os.path.exists(path):
        raise ValueError(f"dataset {path!r} does not exist")
    try:
        ds = load_hub_tasks(path, split=split)
    except (ValueError, OSError) as exc:
        raise ValueError(f"dataset {path!r} cannot be read: {first_line(exc)}") from None
    missing = [c for c in ("context", "question", "answer") if c not in ds.column_names]
    if missing:
        raise ValueError(f"dataset {path!r} lacks the column(s) {', '.join(missing)} of kvpress's schema")
    if len(ds) == 0:
        raise ValueError(f"dataset {path!r} has no rows")
    return ds


# ------------------------------------------------------------------------------------------------ model
def resolve_model(config: FinetuneConfig) -> tuple[str, bool]:
    """``(path or hub id, whether it is a built-in model)`` of ``config.model``; ValueError when a built-in
    model is not built."""
    from kvpress_phase.builtin import BUILTIN_MODELS, DEFAULT_MODEL, builtin_model_path

    name = config.model or DEFAULT_MODEL
    if name not in BUILTIN_MODELS:
        return name, False
    try:
        return builtin_model_path(name), True
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


# ------------------------------------------------------------------------------------------------ one step
def group_by_context_length(examples: list[dict]) -> list[list[int]]:
    """Indices of ``examples`` grouped by ``context_length``, groups in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault(ex["context_length"], []).append(i)
    return list(groups.values())


def forward_group(model, examples: list[dict], press, pad_id: int, autocast):
    """Prefill the contexts of ``examples`` (all of one length) under ``press``, teacher-force question and
    answer on the compressed cache, and return ``(summed answer-token loss, per-row exact match, cache length)``.
    """
    import torch
    import torch.nn.functional as F
    from transformers import DynamicCache

    lm = base_model(model)
    device = next(lm.parameters()).device
    n = examples[0]["context_length"]
    context = torch.tensor([ex["input_ids"][:n] for ex in examples], device=device)
    tails = [ex["input_ids"][n:] for ex in examples]
    masks = [ex["loss_mask"][n:] for ex in examples]
    width = max(len(t) for t in tails)
    qa = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (tail, mask) in enumerate(zip(tails, masks)):
        qa[row, : len(tail)] = torch.tensor(tail)
        labels[row, : len(tail)] = torch.tensor([t if m else -100 for t, m in zip(tail, mask)])
    qa, labels = qa.to(device), labels.to(device)
    # right padding: a real token never attends to the padding after it, and padding carries no loss
    positions = torch.arange(n, n + width, device=device).unsqueeze(0).expand(len(examples), -1)
    cache = DynamicCache()
    with autocast():
        if press is None:
            lm.model(input_ids=context, past_key_values=cache, use_cache=True)
        else:
            with press(lm):
                lm.model(input_ids=context, past_key_values=cache, use_cache=True)
        cache_length = cache.get_seq_length()
        logits = lm(input_ids=qa, past_key_values=cache, position_ids=positions, use_cache=True).logits
    from .loop import answer_exact_match

    shifted = logits[:, :-1].float()
    loss_sum = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=-100, reduction="sum")
    return loss_sum, answer_exact_match(logits.detach(), labels), cache_length


# ------------------------------------------------------------------------------------------------ the run
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

    from .loop import cosine_lr, load_checkpoint, parameter_groups, run_training

    config.validate()
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    if max_minutes is not None and not max_minutes > 0:
        raise ValueError(f"max_minutes must be > 0, got {max_minutes}")
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
    optimizer = torch.optim.AdamW(parameter_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.98))
    record = config.checkpoint_record()
    state = load_checkpoint(checkpoint_dir, record, model, optimizer)

    def step_fn(step: int, state: dict) -> dict:
        micro_batches = []
        for micro in range(config.grad_accum):
            examples, kinds, length = source.micro_batch(step, micro)
            micro_batches.append((config.draw_press(step, micro), examples, length))
        tokens = sum(sum(ex["loss_mask"]) for _, examples, _ in micro_batches for ex in examples)
        loss_total, matches, cache_lengths = 0.0, [], []
        for draw, examples, _ in micro_batches:
            press = config.build_press(draw["ratio"], draw["stride"], draw["offset"]) if draw["ratio"] > 0 else None
            for group in group_by_context_length(examples):
                loss_sum, em, cache_length = forward_group(model, [examples[i] for i in group], press, pad_id,
                                                           autocast)
                (loss_sum / tokens).backward()
                loss_total += float(loss_sum.detach())
                matches += em.tolist()
                cache_lengths.append(cache_length)
        return {"loss": loss_total / tokens, "acc": sum(matches) / len(matches),
                "ratios": [d["ratio"] for d, _, _ in micro_batches],
                "strides": [d["stride"] for d, _, _ in micro_batches],
                "offsets": [d["offset"] for d, _, _ in micro_batches],
                "lengths": [n for _, _, n in micro_batches], "cache_lengths": cache_lengths}

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


def export_finetuned(model, tokenizer, output_dir: str, log: dict, builtin: bool) -> None:
    """Export a plain transformers model (LoRA adapters merged; the adapter alone in ``adapter/``)."""
    from kvpress_phase.evaluation.tokenizer import save_tokenizer
    from .loop import export_model

    if hasattr(model, "merge_and_unload"):
        model.save_pretrained(os.path.join(output_dir, "adapter"))
        model = model.merge_and_unload()
    export_model(model, tokenizer, output_dir, log, save_tokenizer=save_tokenizer if builtin else None,
                 plot_title="compression-aware fine-tuning")


# ------------------------------------------------------------------------------------------------ command line
def _weights(text: str) -> dict:
    """``niah_single:2,niah_multikey`` -> ``{"niah_single": 2.0, "niah_multikey": 1.0}``."""
    out = {}
    for item in text.split(","):
        if not item.strip():
            continue
        name, sep, weight = item.strip().partition(":")
        try:
            out[name] = float(weight) if sep else 1.0
        except ValueError:
            raise argparse.ArgumentTypeError(f"--tasks takes name[:weight],..., got {item!r}") from None
    return out


def _range(text: str) -> list:
    try:
        low, high = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ratio-range takes LOW:HIGH, got {text!r}") from None
    return [low, high]


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvpress-phase train``. Configuration flags default to nothing, so that ``--recipe`` fills
    what the command line leaves out (see :func:`config_from_args`)."""
    S = argparse.SUPPRESS
    d = FinetuneConfig()
    parser.add_argument("--recipe", choices=sorted(RECIPES), default=S,
                        help="start from a named configuration; explicit flags override it")
    parser.add_argument("--model", default=S, help="built-in model name (builtin, chunked), local directory or "
                                                   "hub id (default: the built-in model)")
    parser.add_argument("--press", default=S, help=f"chunked_stride or phase_aware, optionally with :key=value "
                                                   f"settings (default: {d.press})")
    parser.add_argument("--ratios", type=csv_list(float, "--ratios"), default=S,
                        help="compression ratios drawn per micro-batch (default: 0.5)")
    parser.add_argument("--ratio-range", type=_range, default=S,
                        help="LOW:HIGH, draw the ratio uniformly in the range instead of from --ratios")
    parser.add_argument("--strides", type=csv_list(int, "--strides"), default=S, help="strides drawn (default: 8)")
    parser.add_argument("--offset-mode", choices=OFFSET_MODES, default=S,
                        help="grid offset: fixed (--offset) or random in [0, stride) per micro-batch (default: random)")
    parser.add_argument("--offset", type=int, default=S, help="offset of --offset-mode fixed (default: 0)")
    parser.add_argument("--curriculum-steps", type=int, default=S,
                        help="grow the largest ratio drawn from the smallest to the largest over that many steps")
    parser.add_argument("--uncompressed-fraction", type=float, default=S,
                        help="share of micro-batches trained without compression (default: 0)")
    parser.add_argument("--tasks", type=_weights, default=S,
                        help="task[:weight],... of the generated data (default: "
                             + ",".join(DEFAULT_TASKS) + "; an empty string for none)")
    parser.add_argument("--dataset", default=S, help="a dataset in kvpress's schema (save_to_disk folder or "
                                                     ".json/.jsonl/.parquet/.csv file)")
    parser.add_argument("--dataset-split", default=S, help="split of --dataset (default: test)")
    parser.add_argument("--dataset-weight", type=float, default=S,
                        help="weight of the dataset's rows beside the task weights (default: 1)")
    parser.add_argument("--context-lengths", type=csv_list(int, "--context-lengths"), default=S,
                        help="context lengths of the generated examples (default: 512,1024)")
    for name, help_text in [("steps", "optimizer steps"), ("batch-size", "examples per micro-batch"),
                            ("grad-accum", "micro-batches per optimizer step"), ("warmup", "warm-up steps"),
                            ("seed", "seed of data, presses and LoRA initialisation"),
                            ("lora-r", "LoRA rank")]:
        parser.add_argument("--" + name, type=int, default=S,
                            help=f"{help_text} (default: {getattr(d, name.replace('-', '_'))})")
    for name, help_text in [("lr", "peak learning rate"), ("min-lr", "final learning rate"),
                            ("weight-decay", "AdamW weight decay on matrices"), ("clip", "gradient-norm clip"),
                            ("lora-alpha", "LoRA alpha"), ("lora-dropout", "LoRA dropout")]:
        parser.add_argument("--" + name, type=float, default=S,
                            help=f"{help_text} (default: {getattr(d, name.replace('-', '_'))})")
    parser.add_argument("--lora", type=_bool, nargs="?", const=True, default=S,
                        help="train LoRA adapters through peft instead of every weight")
    parser.add_argument("--lora-targets", type=csv_list(str, "--lora-targets"), default=S,
                        help="linear layers that get adapters (default: q_proj,k_proj,v_proj,o_proj)")
    parser.add_argument("--dtype", choices=DTYPES, default=S,
                        help="auto: bfloat16 autocast on CUDA, float32 on the CPU (default: auto)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    parser.add_argument("--output-dir", required=True, help="where the fine-tuned model is exported")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="resumable checkpoints (default: checkpoints/<name of --output-dir>)")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (default: 100)")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="checkpoint and stop after training that long in this call (exit code 3); rerun the "
                             "same command to resume")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    """The configuration of parsed ``train`` flags: the recipe's values, overridden by the flags given."""
    values = dict(RECIPES[args.recipe]) if getattr(args, "recipe", None) else {}
    for f in fields(FinetuneConfig):
        if hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    return FinetuneConfig(**values)


def run_from_args(args: argparse.Namespace, command: Optional[str] = None) -> dict:
    """Run ``kvpress-phase train`` from parsed flags (ValueError for a bad configuration)."""
    config = config_from_args(args)
    output_dir = args.output_dir
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--output-dir {output_dir!r} cannot be created: {exc.strerror}") from None
    return finetune(config, output_dir, args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                    progress=not args.no_progress, device=args.device, threads=args.threads, command=command,
                    max_minutes=args.max_minutes)


__all__ = ["FinetuneConfig", "RECIPES", "DEFAULT_TASKS", "finetune", "forward_group", "add_arguments",
           "config_from_args", "run_from_args"]
