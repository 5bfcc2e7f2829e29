"""The phase evaluation runner: prefill once, replay every compression, decode with kvpress's own code.

kvpress compression changes only the cache: the prefill activations are the same whatever the press. So for each
context the runner prefills once with a capturing press that records, for every hooked attention layer, the
arguments kvpress would hand to ``press.compress``. Every press variant (press x compression ratio x window x grid
offset) is then applied to those recorded inputs, the compressed tensors are put into a shallow copy of the
cache, and each question is decoded greedily with the pipeline's own ``generate_answer``. The answers are the
ones a ``pipeline("kv-press-text-generation")(context, question=..., press=...)`` call per variant would give
(``tests/evaluation/test_runner.py`` checks this).

The prefill records only what the presses under test read (hidden states only for presses that read them, see
:func:`press_reads`), holds one context at a time, and with ``offload="cpu"`` keeps the recorded tensors in CPU
memory (README, "Memory of the replay runner", has the peak-memory formula). Variants are decoded once per distinct
compressed cache (:func:`cache_fingerprint`), and the needle-attention diagnostic is taken from the answer's own
first decoding step (:class:`~.diagnostics.AttentionProbe`).

Results are appended to ``<output_dir>/results/results-rank<r>.jsonl`` one example at a time, with the run's full
config in ``<output_dir>/config.json``. A run restarted with the same arguments skips the examples already in the
shards (a torn last line from a crash is discarded), so nothing is lost or duplicated. One process writes each shard:
a run holds an operating-system lock on ``<output_dir>/.kvpress-phase-rank<r>.lock`` (:func:`output_lock`) and a
second run into the same directory is refused; the lock dies with its process, so a killed run never blocks a
resume. Under ``accelerate launch`` or ``torchrun`` every rank takes every ``world_size``-th work unit and writes its
own shard; rank 0 merges the shards in a deterministic order once all ranks are done.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Optional

import pandas as pd
import torch
from kvpress import BasePress, KVPressTextGenerationPipeline

from .presses import PHASE_GRID_PRESSES, PressSpec, build_press, parse_press_spec
from .prompting import check_tokenizer
from .tasks import PROTOCOLS, generate, get_task, score

RESULTS_DIR = "results"


# ------------------------------------------------------------------------------------------------ config
@dataclass
class EvalConfig:
    """Everything that determines a phase evaluation's results (saved with them)."""

    model: Optional[str] = None
    tasks: list = field(default_factory=lambda: ["niah_single"])
    presses: list = field(default_factory=lambda: ["no_press", "chunked_stride", "phase_aware"])
    compression_ratios: list = field(default_factory=lambda: [0.5])
    strides: list = field(default_factory=lambda: [8])
    windows: Optional[list] = None
    phases: Optional[list] = None
    protocol: str = "prefix"
    context_lengths: list = field(default_factory=lambda: [512])
    samples: int = 10
    seed: int = 0
    dtype: str = "float32"
    diagnostics: bool = True
    matched_cache: bool = False

    def validate(self) -> None:
        for name in self.tasks:
            get_task(name)
        for spec in self.presses:
            parse_press_spec(spec)
        if not self.tasks or not self.presses:
            raise ValueError("tasks and presses must not be empty")
        for r in self.compression_ratios:
            if not 0 <= r < 1:
                raise ValueError(f"compression ratio must be in [0, 1), got {r}")
        for s in self.strides:
            if s < 1:
                raise ValueError(f"stride must be >= 1, got {s}")
        for w in self.windows or []:
            if w < min(self.strides):
                raise ValueError(f"window must be >= stride, got window {w} with strides {self.strides}")
        for p in self.phases or []:
            if not 0 <= p < min(self.strides):
                raise ValueError(f"phase must be in [0, stride), got phase {p} with strides {self.strides}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        for n in self.context_lengths:
            if n < 16:
                raise ValueError(f"context length must be >= 16 tokens, got {n}")
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ replay
HIDDEN_STATES, ATTENTIONS = "hidden_states", "attentions"
OFFLOAD_CHOICES = (None, "cpu")


def press_reads(press: Optional[BasePress]) -> frozenset:
    """Which optional compress inputs ``press`` reads: a subset of ``{"hidden_states", "attentions"}``.

    Keys, values and the layer's kwargs are always recorded. Only presses known to ignore the hidden states and the
    attention weights are listed here; any other press is assumed to read both, so nothing it needs is dropped.
    """
    from kvpress import ChunkKVPress, ChunkPress, KnormPress, StreamingLLMPress

    from kvpress_phase.presses import WindowedPress

    if press is None or type(press) in (KnormPress, StreamingLLMPress):
        return frozenset()
    if type(press) in (ChunkPress, ChunkKVPress):  # they assert that no attention weights are passed
        return frozenset({ATTENTIONS}) | press_reads(press.press)
    if isinstance(press, WindowedPress):  # keys, values and the scorer's inputs
        return press_reads(press.scorer)
    return frozenset({HIDDEN_STATES, ATTENTIONS})


def _not_captured(tensor: torch.Tensor) -> torch.Tensor:
    """A stand-in with ``tensor``'s shape and dtype and no data: any computation with it fails loudly."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


@dataclass
class _CapturePress(BasePress):
    """Records what kvpress hands to ``compress`` on every hooked layer, and compresses nothing.

    ``reads`` names the optional inputs to keep (hidden states, attention weights); the others are replaced by
    data-less stand-ins. With ``offload`` set, the recorded keys, values and hidden states are moved to that device
    and the layer's cache entry is emptied, so the prefill holds at most one layer's keys and values at a time.
    """

    inputs: dict = field(default_factory=dict)
    reads: frozenset = frozenset({HIDDEN_STATES, ATTENTIONS})
    offload: Optional[str] = None

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        hidden = hidden_states if HIDDEN_STATES in self.reads else _not_captured(hidden_states)
        attentions = attentions if ATTENTIONS in self.reads else None
        if self.offload is not None and hidden.device.type != "meta":
            hidden = hidden.to(self.offload)
        kept = {k: v for k, v in kwargs.items() if k != "past_key_values"}
        if "hidden_states" in kept:  # the same tensor as ``hidden_states``: keep only what is recorded
            kept["hidden_states"] = hidden
        if self.offload is None:
            self.inputs[module.layer_idx] = (module, hidden, keys, values, attentions, kept)
            return keys, values
        attentions = attentions.to(self.offload) if attentions is not None else None
        self.inputs[module.layer_idx] = (module, hidden, keys.to(self.offload), values.to(self.offload), attentions,
                                         kept)
        return keys[:, :, :0].clone(), values[:, :, :0].clone()  # the layer's entries now live on self.offload


@dataclass
class Prefill:
    """One prefilled context: its token count, its full cache, and the recorded compress inputs.

    ``reads`` lists the optional inputs that were recorded; with ``offload`` the recorded tensors live on that
    device and ``cache`` holds no entries for the recorded layers.
    """

    context_length: int
    cache: object
    inputs: dict
    reads: frozenset = frozenset({HIDDEN_STATES, ATTENTIONS})
    offload: Optional[str] = None
    memo: dict = field(default_factory=dict, repr=False)

    def captured_bytes(self) -> int:
        """Bytes held by the recorded tensors and the cache (each storage counted once)."""
        seen, total = set(), 0

        def add(t):
            nonlocal total
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                key = (t.device, t.untyped_storage().data_ptr())
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
            elif isinstance(t, (tuple, list)):
                for x in t:
                    add(x)
            elif isinstance(t, dict):
                for x in t.values():
                    add(x)

        for _, hidden, keys, values, attentions, kwargs in self.inputs.values():
            add((hidden, keys, values, attentions, kwargs))
        for layer in self.cache.layers:
            add((getattr(layer, "keys", None), getattr(layer, "values", None)))
        return total


class ReplayEngine:
    """Prefill a context once; answer questions under any press from the recorded compress inputs.

    ``offload="cpu"`` keeps the recorded tensors on the CPU: the model's device then holds, besides the weights, one
    layer's uncompressed keys and values at a time and the compressed cache being decoded (see the README's memory
    section).
    """

    def __init__(self, model, tokenizer, offload: Optional[str] = None):
        if offload not in OFFLOAD_CHOICES:
            raise ValueError(f"offload must be one of {OFFLOAD_CHOICES}, got {offload!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.offload = offload
        self.pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=model.device)

    def encode(self, context: str, questions: list[str], answer_prefix: str = ""):
        max_len = min(self.tokenizer.model_max_length, int(1e10))
        return self.pipe.preprocess(context, questions, answer_prefix, max_len)

    @torch.inference_mode()
    def prefill(self, context_ids: torch.Tensor, presses: Optional[Iterable] = None) -> Prefill:
        """Prefill ``context_ids`` and record the compress inputs that ``presses`` read (all of them when None)."""
        from transformers import DynamicCache

        reads = frozenset({HIDDEN_STATES, ATTENTIONS}) if presses is None else \
            frozenset().union(*[press_reads(p) for p in presses])
        capture = _CapturePress(reads=reads, offload=self.offload)
        cache = DynamicCache()
        with capture(self.model):
            self.model.model(input_ids=context_ids.to(self.model.device), past_key_values=cache)
        return Prefill(context_ids.shape[1], cache, capture.inputs, reads, self.offload)

    @torch.inference_mode()
    def compressed_cache(self, state: Prefill, press: Optional[BasePress]):
        """A cache holding ``press``'s compression of ``state`` (the original tensors are not modified)."""
        missing = press_reads(press) - state.reads
        if missing:
            raise ValueError(
                f"{type(press).__name__} reads {', '.join(sorted(missing))}, which this prefill did not record; "
                "pass the press to prefill(..., presses=[...])"
            )
        cache = copy.copy(state.cache)
        cache.layers = [copy.copy(layer) for layer in state.cache.layers]
        if press is None and state.offload is None:
            return cache
        if press is not None:
            press.post_init_from_model(self.model)
        device = self.model.device
        for layer_idx, (module, hidden, keys, values, attentions, kwargs) in state.inputs.items():
            if state.offload is not None:  # bring one layer back at a time
                hidden, keys, values, attentions = [
                    t.to(device) if t is not None and t.device.type != "meta" else t
                    for t in (hidden, keys, values, attentions)
                ]
                if "hidden_states" in kwargs:
                    kwargs = {**kwargs, "hidden_states": hidden}
            if press is None:
                new_keys, new_values = keys, values
            else:
                new_keys, new_values = press.compress(module, hidden, keys, values, attentions, kwargs)
            cache.layers[layer_idx].keys = new_keys
            cache.layers[layer_idx].values = new_values
        return cache

    @torch.inference_mode()
    def answer(self, state: Prefill, press: Optional[BasePress], questions_ids: list, max_new_tokens: int,
               attention_rows: Optional[dict] = None, cache=None):
        """Greedy answers to every question, exactly as the kvpress pipeline decodes them.

        With ``attention_rows`` (a dict), the attention of the first question's last token over every recorded
        layer's cache is stored in it during the first decoding step (see ``diagnostics.AttentionProbe``).
        ``cache`` is ``compressed_cache(state, press)`` when the caller already has it.
        """
        from .diagnostics import AttentionProbe

        cache = cache if cache is not None else self.compressed_cache(state, press)
        answers = []
        for n, question_ids in enumerate(questions_ids):
            lengths = [cache.get_seq_length(i) for i in range(len(cache))]
            recording = n == 0 and attention_rows is not None
            with AttentionProbe(self.model, state.inputs, attention_rows) if recording else contextlib.nullcontext():
                answers.append(
                    self.pipe.generate_answer(
                        question_ids=question_ids.to(self.model.device),
                        cache=cache,
                        context_length=state.context_length,
                        max_new_tokens=max_new_tokens,
                    )
                )
            self.pipe._remove_answer_from_cache(cache, lengths)
        return answers, cache

    @torch.inference_mode()
    def attention_rows(self, state: Prefill, press: Optional[BasePress], question_ids: torch.Tensor,
                       cache=None) -> tuple:
        """The question's last-token attention rows over ``press``'s cache (and the cache), from one forward of the
        question without decoding."""
        from .diagnostics import AttentionProbe

        cache = cache if cache is not None else self.compressed_cache(state, press)
        lengths = [cache.get_seq_length(i) for i in range(len(cache))]
        rows: dict = {}
        positions = torch.arange(state.context_length, state.context_length + question_ids.shape[1],
                                 device=self.model.device)[None]
        with AttentionProbe(self.model, state.inputs, rows):
            self.model.model(input_ids=question_ids.to(self.model.device), past_key_values=cache,
                             position_ids=positions)
        self.pipe._remove_answer_from_cache(cache, lengths)
        return rows, cache


KEPT_ROWS_BYTES = 32 * 2**20
"""The diagnostic's attention rows of a decoded cache are kept for variants with the same cache up to this size;
larger ones (large models at long context) are recomputed by one question forward when needed."""


def cache_fingerprint(state: Prefill, cache) -> tuple:
    """A key that differs between compressed caches that differ in any recorded layer's entries.

    Per recorded layer: the shapes of keys and values and, for each, the sum over entries of a random projection in
    float64 weighted by random per-entry weights (a one-ulp change of one element moves it by many ulps of the
    sum). Two caches with equal keys decode every question identically.
    """
    if "fingerprint_vectors" not in state.memo:
        g = torch.Generator().manual_seed(1234)
        state.memo["fingerprint_vectors"] = {}
        state.memo["fingerprint_generator"] = g
    vectors, g = state.memo["fingerprint_vectors"], state.memo["fingerprint_generator"]
    sums, shapes = [], []
    for layer_idx in state.inputs:
        for t in (cache.layers[layer_idx].keys, cache.layers[layer_idx].values):
            n, d = t.shape[-2], t.shape[-1]
            if (n, d) not in vectors:
                vectors[(n, d)] = (torch.randn(d, generator=g, dtype=torch.float64).to(t.device),
                                   torch.randn(n, generator=g, dtype=torch.float64).to(t.device))
            r, w = vectors[(n, d)]
            sums.append(((t.double() @ r) * w).sum())
            shapes.append(tuple(t.shape))
    return tuple(shapes), tuple(torch.stack(sums).tolist()) if sums else ()


# ------------------------------------------------------------------------------------------------ shards
def _read_shard(path: str) -> list[dict]:
    """Records of a JSONL shard; a torn last line (interrupted write) is cut off the file."""
    if not os.path.exists(path):
        return []
    records, good_bytes = [], 0
    with open(path, "rb") as fh:
        for raw in fh:
            try:
                records.append(json.loads(raw))
            except json.JSONDecodeError:
                break
            if not raw.endswith(b"\n"):
                records.pop()
                break
            good_bytes += len(raw)
    if good_bytes != os.path.getsize(path):
        with open(path, "r+b") as fh:
            fh.truncate(good_bytes)
    return records


def record_key(record: dict) -> str:
    fields = ("task", "context_length", "stride", "window", "protocol", "sample_id", "phase", "press",
              "compression_ratio")
    return "|".join(str(record[f]) for f in fields)


def read_results(output_dir: str) -> pd.DataFrame:
    """All shards of a run, deduplicated by example key and sorted deterministically."""
    folder = os.path.join(output_dir, RESULTS_DIR)
    records = []
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".jsonl"):
                records.extend(_read_shard(os.path.join(folder, name)))
    if not records:
        return pd.DataFrame()
    df = pd.DataFrame(records).drop_duplicates("key", keep="first")
    order = ["task", "context_length", "stride", "window_sort", "protocol", "sample_id", "phase", "press",
             "compression_ratio"]
    df["window_sort"] = df["window"].astype(float).fillna(0.0)
    return df.sort_values(order, kind="stable").drop(columns="window_sort").reset_index(drop=True)


# ------------------------------------------------------------------------------------------------ one writer
class OutputDirInUse(ValueError):
    """Another process is writing to the same output directory (and shard)."""


_HELD_LOCKS: dict = {}  # lock path -> [FileLock, depth]: the lock is re-entrant within a process


def lock_path(output_dir: str, rank: int = 0) -> str:
    return os.path.join(os.path.abspath(output_dir), f".kvpress-phase-rank{rank}.lock")


@contextlib.contextmanager
def output_lock(output_dir: str, rank: int = 0):
    """Hold the lock of ``output_dir``'s shard ``rank``, or raise :class:`OutputDirInUse` at once.

    An operating-system file lock (``flock`` through ``filelock``): it is released when the holder exits, even when
    it is killed, so a stale lock file never blocks a resume. Re-entrant within one process.
    """
    from filelock import FileLock, Timeout

    path = lock_path(output_dir, rank)
    held = _HELD_LOCKS.get(path)
    if held is None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = FileLock(path, timeout=0)
        try:
            lock.acquire()
        except Timeout:
            raise OutputDirInUse(
                f"output directory {output_dir!r} is in use by another run (lock {path}); wait for it to finish "
                "or use another --output-dir"
            ) from None
        held = _HELD_LOCKS[path] = [lock, 0]
    held[1] += 1
    try:
        yield
    finally:
        held[1] -= 1
        if held[1] == 0:
            del _HELD_LOCKS[path]
            held[0].release()


# ------------------------------------------------------------------------------------------------ the run
@dataclass
class WorkUnit:
    """All phases of one base sample of one task x context length x stride: one prefill per distinct text."""

    task: str
    context_length: int
    stride: int
    sample_id: int
    rows: list


def plan_units(config: EvalConfig, tokenizer) -> list[WorkUnit]:
    units = []
    for task in config.tasks:
        for context_length in config.context_lengths:
            for stride in config.strides:
                phases = config.phases if config.phases is not None else list(range(stride))
                ds = generate(task, tokenizer, n_samples=config.samples, context_length=context_length,
                              stride=stride, phases=phases, protocol=config.protocol, seed=config.seed)
                by_sample: dict[int, list] = {}
                for row in ds:
                    by_sample.setdefault(row["sample_id"], []).append(row)
                units += [WorkUnit(task, context_length, stride, sid, rows) for sid, rows in sorted(by_sample.items())]
    return units


def variants(config: EvalConfig, stride: int) -> list[tuple[PressSpec, float, Optional[int]]]:
    out = []
    for text in config.presses:
        spec = parse_press_spec(text)
        if spec.name == "no_press":
            out.append((spec, 0.0, None))
            continue
        windows = config.windows if (config.windows and spec.name in PHASE_GRID_PRESSES) else [None]
        for ratio in config.compression_ratios:
            for window in windows:
                if window is not None and window < stride:
                    continue
                out.append((spec, float(ratio), window))
    return out


def distributed_state():
    """(rank, world size, barrier) from accelerate when launched with several processes; (0, 1, noop) else."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import PartialState

        state = PartialState(cpu=not torch.cuda.is_available())
        return state.process_index, state.num_processes, state.wait_for_everyone
    return 0, 1, lambda: None


def check_context_lengths(config: EvalConfig, model) -> Optional[str]:
    """Warn (and return the message) when a context length exceeds the model's ``max_position_embeddings``.

    Such a run is not refused, but its answers say nothing about compression (the model never saw those positions)
    and every answer is far slower than at the lengths the model knows.
    """
    model_config = getattr(model, "config", None)
    if model_config is not None and hasattr(model_config, "get_text_config"):
        model_config = model_config.get_text_config()
    limit = getattr(model_config, "max_position_embeddings", None)
    too_long = sorted(n for n in config.context_lengths if limit is not None and n > limit)
    if not too_long:
        return None
    from kvpress_phase.builtin import builtin_model_name, builtin_training_length

    name = builtin_model_name(model)
    length = builtin_training_length(name) if name else None
    trained = (f"the built-in model {name!r} was trained on sequences of up to {length} tokens"
               if length else "the model was not trained on positions past it")
    lengths = ", ".join(str(n) for n in too_long)
    message = (
        f"context length {lengths} exceeds the model's max_position_embeddings ({limit}), and {trained}: "
        "accuracy at such lengths says nothing about compression, and each answer takes much longer"
    )
    warnings.warn(message, UserWarning, stacklevel=2)
    return message


def run_evaluation(config: EvalConfig, model, tokenizer, output_dir: str, *, progress: bool = True,
                   max_units: Optional[int] = None, offload: Optional[str] = None) -> pd.DataFrame:
    """Run (or resume) ``config`` and return the merged per-example results.

    ``max_units`` stops after that many work units of this rank (used to test interruption). A tokenizer that
    the pipeline or the task generators cannot use (not fast, or neither a BOS token nor a chat template)
    raises ValueError before anything is written or run. One writer per output directory: the run holds
    ``output_lock(output_dir, rank)`` and raises :class:`OutputDirInUse` (a ValueError) when another process
    holds it. ``offload="cpu"`` keeps the recorded prefill on the CPU (see :class:`ReplayEngine`); it changes
    memory use, not results.
    """
    config.validate()
    check_tokenizer(tokenizer)
    check_context_lengths(config, model)
    rank, world, barrier = distributed_state()
    with output_lock(output_dir, rank):
        return _run_locked(config, model, tokenizer, output_dir, rank, world, barrier, progress, max_units, offload)


def _run_locked(config, model, tokenizer, output_dir, rank, world, barrier, progress, max_units, offload):
    from tqdm.auto import tqdm

    os.makedirs(os.path.join(output_dir, RESULTS_DIR), exist_ok=True)
    config_path = os.path.join(output_dir, "config.json")
    saved = {"config": dataclasses.asdict(config), "fingerprint": config.fingerprint()}
    if os.path.exists(config_path):
        with open(config_path) as fh:
            previous = json.load(fh)
        if previous.get("fingerprint") != saved["fingerprint"]:
            raise ValueError(
                f"output directory {output_dir!r} holds results of a different configuration; "
                "use another --output-dir or the same arguments to resume"
            )
    elif rank == 0:
        with open(config_path, "w") as fh:
            json.dump(saved, fh, indent=2)

    shard_path = os.path.join(output_dir, RESULTS_DIR, f"results-rank{rank}.jsonl")
    done = {r["key"] for r in _read_shard(shard_path)}
    units = plan_units(config, tokenizer)[rank::world]
    engine = ReplayEngine(model, tokenizer, offload=offload)
    todo = [(u, v) for u in units for v in [variants(config, u.stride)]]
    bar = tqdm(total=sum(len(u.rows) * len(v) for u, v in todo), disable=not progress or rank != 0,
               desc="phase eval", unit="answer", initial=0)
    with open(shard_path, "a") as shard:
        for n_unit, (unit, unit_variants) in enumerate(todo):
            if max_units is not None and n_unit >= max_units:
                break
            _run_unit(engine, config, unit, unit_variants, done, shard, bar)
    bar.close()
    barrier()
    results = read_results(output_dir)
    return results


def _run_unit(engine, config, unit, unit_variants, done, shard, bar):
    """Answer every (row, variant) of ``unit`` not yet in ``done``, appending one record per answer to ``shard``.

    Rows that share a context share one prefill, and three kinds of reuse keep the answers those of one pipeline
    call per variant: a variant that does not depend on the row (a press without a grid offset) is answered once
    per context and question; a variant whose compressed cache equals an earlier one's (``cache_fingerprint``, e.g.
    an aligned PhaseAwarePress, whose grid does not use the offset) reuses that answer; and the uncompressed
    reference of the diagnostic comes from the ``no_press`` variant's forward when there is one.
    """
    from .diagnostics import needle_mass

    # what the unit's presses read decides what the prefill records (offsets do not change it)
    reads_of = [build_press(spec, ratio, unit.stride, window, 0) for spec, ratio, window in unit_variants]
    prefills: dict[str, Prefill] = {}
    encodings: dict[tuple, dict] = {}
    memo: dict[tuple, tuple] = {}  # (context, question, variant, offset) -> (prediction, cache length, mass)
    decoded: dict[tuple, tuple] = {}  # (context, question, cache fingerprint) -> (prediction, attention rows)
    full_masses: dict[tuple, float] = {}
    for row in unit.rows:
        for spec, ratio, window in unit_variants:
            record = {
                "task": unit.task, "context_length": unit.context_length, "stride": unit.stride,
                "window": window, "protocol": row["protocol"], "sample_id": row["sample_id"],
                "phase": row["phase"], "press": spec.label, "compression_ratio": ratio,
            }
            record["key"] = record_key(record)
            if record["key"] in done:
                bar.update(1)
                continue
            context = row["context"]
            prompt = (context, row["question"], row["answer_prefix"], row["max_new_tokens"])
            if prompt not in encodings:
                encodings[prompt] = engine.encode(context, [row["question"]], row["answer_prefix"])
            encoded = encodings[prompt]
            if context not in prefills:
                prefills.clear()  # one prefill at a time: the rows of a unit come grouped by context
                prefills[context] = engine.prefill(encoded["context_ids"], presses=reads_of)
            state = prefills[context]
            question_ids = encoded["questions_ids"][0]
            needle = (row["needle_token_start"], row["needle_token_end"])
            offset = row["offset"] if spec.name in PHASE_GRID_PRESSES else 0
            memo_key = (prompt, spec.label, ratio, window, offset)
            if memo_key not in memo:
                press = build_press(spec, ratio, unit.stride, window, offset,
                                    matched_context_length=state.context_length if config.matched_cache else None)
                cache = engine.compressed_cache(state, press)
                cache_len = cache.get_seq_length(0)
                same_cache = (prompt, cache_fingerprint(state, cache))
                if same_cache in decoded:
                    prediction, rows = decoded[same_cache]
                    if config.diagnostics and rows is None:  # rows too large to keep: one question forward
                        rows, cache = engine.attention_rows(state, press, question_ids, cache=cache)
                else:
                    rows = {} if config.diagnostics else None
                    answers, cache = engine.answer(state, press, encoded["questions_ids"], row["max_new_tokens"],
                                                   attention_rows=rows, cache=cache)
                    prediction = answers[0]
                    small = rows is not None and sum(r.nbytes for r in rows.values()) <= KEPT_ROWS_BYTES
                    decoded[same_cache] = (prediction, rows if small else None)
                mass = None
                if rows is not None:  # the entries' source spans are this press's own
                    mass = needle_mass(rows, state, press, cache, needle, question_ids.shape[1])
                    if press is None:  # the uncompressed reference, from the same forward
                        full_masses[prompt] = mass
                press_ratio = getattr(press, "compression_ratio", 0.0) if press is not None else 0.0
                memo[memo_key] = (prediction, cache_len, mass, press_ratio)
                del cache, rows  # before the next variant's cache is built
            prediction, cache_len, mass, press_ratio = memo[memo_key]
            full_mass = None
            if config.diagnostics:
                if prompt not in full_masses:  # no uncompressed variant run for this prompt: one question forward
                    rows, cache = engine.attention_rows(state, None, question_ids)
                    full_masses[prompt] = needle_mass(rows, state, None, cache, needle, question_ids.shape[1])
                full_mass = full_masses[prompt]
            record.update({
                "offset": row["offset"], "seed": row["seed"], "depth": row["depth"],
                "context_tokens": row["context_length"], "answer_token_start": row["answer_token_start"],
                "answer": list(row["answer"]), "prediction": prediction,
                "score": score(prediction, row["answer"], unit.task), "cache_length": cache_len,
                "press_ratio": press_ratio,
                "needle_attention": mass,
                "needle_attention_ratio": (mass / full_mass) if mass is not None and full_mass else None,
            })
            shard.write(json.dumps(record) + "\n")
            shard.flush()
            done.add(record["key"])
            bar.update(1)
