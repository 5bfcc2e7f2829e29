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
shards, so nothing is lost or duplicated: a torn last line (a write cut short, no newline) is moved to
``results-rank<r>.jsonl.cut`` and its example run again, and any other unreadable line is skipped with a warning
naming the file and line but left in place (:func:`_read_shard`). Reading results (:func:`read_results`,
``kvpress-phase report``) never changes a shard. One process writes each shard: a run holds an operating-system
lock on ``<output_dir>/.kvpress-phase-rank<r>.lock`` (:func:`output_lock`) and a second run into the same directory
is refused; the lock dies with its process, so a killed run never blocks a resume. A command that fails before
writing any result (a model that cannot be loaded) removes what it created there (:func:`removed_if_failed_empty`).
Under ``accelerate launch`` or ``torchrun`` every rank takes every ``world_size``-th work unit and writes its own
shard; rank 0 merges the shards in a deterministic order once all ranks are done.
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
from .tasks import PROTOCOLS, check_context_length, generate, get_task, score

RESULTS_DIR = "results"
SETTINGS = {False: "query_agnostic", True: "question_compressed"}
"""The ``setting`` column: the question appended after compression (kvpress's pipeline, query-agnostic) or
compressed with the context (query-aware: ``--query-aware``, formerly ``--compress-question``). The stored values
stay as they are; reports label them query-agnostic and query-aware."""


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
    compress_question: bool = False
    allow_duplicate_k: bool = False
    decode_batch: int = 16
    step_by_step: bool = False

    def validate(self) -> None:
        for name in self.tasks:
            get_task(name)
        labels = [parse_press_spec(spec).label for spec in self.presses]
        if not self.tasks or not self.presses:
            raise ValueError("tasks and presses must not be empty")
        for i, label in enumerate(labels):
            if label in labels[:i]:
                raise ValueError(f"presses lists {label!r} twice: give each press once")
        for r in self.compression_ratios:
            if not 0 <= r < 1:
                raise ValueError(f"compression ratio must be in [0, 1), got {r}")
        positive = [r for r in self.compression_ratios if r > 0]
        for s in self.strides:
            if s < 1:
                raise ValueError(f"stride must be >= 1, got {s}")
            if s == 1 and positive and labels != ["no_press"]:
                raise ValueError(f"stride 1 cannot run compression ratio {positive[0]:g}: a stride of 1 makes "
                                 "one-token windows and each keeps its token, so nothing would be compressed; use "
                                 "strides of 2 or more")
        for w in self.windows or []:
            if w < min(self.strides):
                raise ValueError(f"window must be >= stride, got window {w} with strides {self.strides}")
        for p in self.phases or []:
            if not 0 <= p < min(self.strides):
                raise ValueError(f"phase must be in [0, stride), got phase {p} with strides {self.strides}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        for n in self.context_lengths:
            check_context_length(n, max(self.strides, default=1))
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.decode_batch < 1:
            raise ValueError(f"decode batch must be >= 1, got {self.decode_batch}")
        if not self.allow_duplicate_k:
            duplicate = duplicate_k(self.compression_ratios, self.strides)
            if duplicate:
                raise ValueError(duplicate + "; drop one, or allow it explicitly (--allow-duplicate-k)")

    def fingerprint(self) -> str:
        values = dataclasses.asdict(self)
        for name, default in _LATER_FIELDS.items():  # fields added later: at their defaults, old runs resume
            if values.get(name) == default:
                values.pop(name)
        return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]

    def resumes(self, fingerprint: Optional[str]) -> bool:
        """Whether results saved under ``fingerprint`` are this configuration's: its own fingerprint, or, on the
        default model, that of a run saved before the command recorded the default model's name (model null)."""
        from kvpress_phase.builtin import DEFAULT_MODEL

        if fingerprint == self.fingerprint():
            return True
        return self.model == DEFAULT_MODEL and fingerprint == dataclasses.replace(self, model=None).fingerprint()


_LATER_FIELDS = {"compress_question": False, "allow_duplicate_k": False, "decode_batch": 16, "step_by_step": False}


def duplicate_k(ratios, strides) -> Optional[str]:
    """A message when two of ``ratios`` keep the same number of entries per window at one of ``strides`` (the sweep
    would run one configuration twice under two names), else None."""
    from kvpress_phase.phase import kept_per_window

    for stride in strides:
        seen: dict = {}
        for ratio in ratios:
            if ratio == 0:
                continue
            k = kept_per_window(stride, ratio)
            if k in seen and seen[k] != ratio:
                return (f"compression ratios {seen[k]:g} and {ratio:g} both keep k={k} of {stride} tokens per window "
                        f"at stride {stride} (per-window ratio {1 - k / stride:g}): the same configuration twice")
            seen[k] = ratio
    return None


# ------------------------------------------------------------------------------------------------ replay
HIDDEN_STATES, ATTENTIONS = "hidden_states", "attentions"
OFFLOAD_CHOICES = (None, "cpu")


def press_reads(press: Optional[BasePress]) -> frozenset:
    """Which optional compress inputs ``press`` reads: a subset of ``{"hidden_states", "attentions"}``.

    Keys, values and the layer's kwargs are always recorded. Only presses known to ignore the hidden states and the
    attention weights are listed here; any other press is assumed to read both, so nothing it needs is dropped.
    """
    from kvpress import ChunkKVPress, ChunkPress, KeyDiffPress, KnormPress, StreamingLLMPress

    from kvpress_phase.presses import WindowedPress

    from kvpress_phase.presses.scorers import KVzipScorer

    if press is None or type(press) in (KnormPress, KeyDiffPress, StreamingLLMPress, KVzipScorer):
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
    context_ids: Optional[torch.Tensor] = field(default=None, repr=False)

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
    section). ``step_by_step=True`` decodes every answer token by token over a growing ``DynamicCache`` (the
    reference path of :func:`.decoding.decode_tokens`) instead of checking drafts in cache buffers allocated once.
    """

    def __init__(self, model, tokenizer, offload: Optional[str] = None, step_by_step: bool = False):
        if offload not in OFFLOAD_CHOICES:
            raise ValueError(f"offload must be one of {OFFLOAD_CHOICES}, got {offload!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.offload = offload
        self.step_by_step = step_by_step
        self.pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=model.device)

    def encode(self, context: str, questions: list[str], answer_prefix: str = ""):
        max_len = min(self.tokenizer.model_max_length, int(1e10))
        return self.pipe.preprocess(context, questions, answer_prefix, max_len)

    def shared_prefill(self, context_ids: torch.Tensor, presses: Optional[Iterable] = None) -> Prefill:
        """:meth:`prefill`, reusing the last prefill when it was of the same tokens and recorded what ``presses``
        read (the offset protocol's text does not depend on the stride, so a sweep over strides prefills, scores and
        decodes the uncompressed control once per context). One prefill is kept."""
        reads = frozenset({HIDDEN_STATES, ATTENTIONS}) if presses is None else \
            frozenset().union(*[press_reads(p) for p in presses])
        last = getattr(self, "_last_prefill", None)
        if last is not None and reads <= last.reads and torch.equal(last.context_ids, context_ids):
            return last
        self._last_prefill = None  # free it before the next prefill
        self._last_prefill = self.prefill(context_ids, presses)
        return self._last_prefill

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
        return Prefill(context_ids.shape[1], cache, capture.inputs, reads, self.offload, context_ids=context_ids)

    @torch.inference_mode()
    def compressed_cache(self, state: Prefill, press: Optional[BasePress]):
        """A cache holding ``press``'s compression of ``state`` (the original tensors are not modified).

        For a press that masks instead of removing (kvpress's ``KVzipPress``) the cache is the full one; its masks
        are :meth:`masks`."""
        if _is_kvzip(press):
            return self.compressed_cache(state, None)
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
            if getattr(getattr(press, "scorer", None), "needs_context", False):  # KVzipScorer: once per prefill
                press.scorer.scores = self._kvzip_scores(state)
        device = self.model.device
        with _shared_scores(press, state):
            self._compress_layers(state, press, cache, device)
        return cache

    def _compress_layers(self, state: Prefill, press, cache, device) -> None:
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

    def masks(self, state: Prefill, press: Optional[BasePress]):
        """The entries ``press`` masks in ``state``'s cache while decoding (:data:`.decoding.Masks`), or None for
        a press that removes entries. KVzip's scores are computed once per prefill and reused for every ratio."""
        if not _is_kvzip(press) or press.compression_ratio == 0:
            return None
        from .decoding import kvzip_masks
        return kvzip_masks(self.model, self._kvzip_scores(state), press.compression_ratio)

    def _kvzip_scores(self, state: Prefill) -> torch.Tensor:
        """KVzip's reconstruction scores of ``state``'s context, computed once per prefill (they serve kvpress's
        ``KVzipPress`` at every ratio and our presses' ``KVzipScorer``)."""
        from .decoding import kvzip_scores

        if state.offload is not None:
            raise ValueError("KVzip replays the context over the full cache, which offload='cpu' does not keep")
        if "kvzip_scores" not in state.memo:
            state.memo["kvzip_scores"] = kvzip_scores(self.model, self.tokenizer, state.context_ids, state.cache)
        return state.memo["kvzip_scores"]

    @torch.inference_mode()
    def answer_many(self, state: Prefill, presses: list, question_ids: torch.Tensor, max_new_tokens: int, *,
                    needles: Optional[list] = None, batch_size: int = 16) -> list[dict]:
        """Greedy answers to one question under every press of ``presses``, decoded in batches.

        Presses whose compressed caches are equal are decoded once (:func:`cache_fingerprint`, masks included);
        caches of equal shapes are decoded together, up to ``batch_size`` at a time (:func:`.decoding.decode_tokens`,
        the first answer drafting the others unless the engine decodes step by step; ``batch_size=1`` step by step
        gives exactly the pipeline's answers). With ``needles`` (a list of token spans), the
        needle-attention diagnostic of every press for every span is taken from the answer's first decoding step.
        Returns, per press: ``prediction``, ``cache_length`` (mean entries per layer and KV head that decoding
        attends to), ``masses`` (one per needle, or None).
        """
        from .decoding import answer_text, cache_signature, decode_tokens
        from .diagnostics import AttentionProbe, needle_mass

        out: list = [None] * len(presses)
        # fingerprint -> (prediction, rows), kept with the prefill for every question asked of it
        question_key = (tuple(question_ids[0].tolist()), max_new_tokens)
        decoded = state.memo.setdefault(("decoded", *question_key, bool(needles)), {})
        draft_key = ("draft", *question_key)
        q_len = question_ids.shape[1]
        built: dict = {}  # press index -> (cache, masks, fingerprint), until its answer is known
        waiting: dict = {}  # cache signature -> press indices whose caches are to be decoded together

        def decode(members):
            rows = {} if needles else None
            probe = AttentionProbe(self.model, state.inputs, rows) if needles else None
            # the first answer to this question (the uncompressed one, which sorts first) drafts the others
            draft = state.memo.get(draft_key)
            tokens = decode_tokens(self.model, [built[i][0] for i in members], question_ids, state.context_length,
                                   max_new_tokens, masks=[built[i][1] for i in members], probe=probe, draft=draft,
                                   step_by_step=self.step_by_step)
            state.memo.setdefault(draft_key, tokens[0])
            for j, i in enumerate(members):
                own = None
                if rows is not None:  # this row's attention, without the padding of shorter layers
                    cache = built[i][0]
                    own = {}
                    for layer, r in rows.items():
                        n = cache.layers[layer].keys.shape[2]
                        own[layer] = torch.cat([r[j:j + 1, :, :n], r[j:j + 1, :, r.shape[-1] - q_len:]], dim=-1)
                decoded[built[i][2]] = (answer_text(self.tokenizer, tokens[j]), own)
            finish()

        def finish():
            for i in [i for i in built if built[i][2] in decoded]:  # every press whose answer is now known
                cache, masks, fp = built.pop(i)
                prediction, rows = decoded[fp]
                masses = None
                if needles:
                    masses = [needle_mass(rows, state, presses[i], cache, needle, q_len) for needle in needles]
                out[i] = {"prediction": prediction, "cache_length": _attended_length(cache, masks),
                          "masses": masses}

        # Step by step, the presses are decoded in consecutive chunks of batch_size, each chunk's caches grouped by
        # shape. Otherwise up to 4 * batch_size caches wait to be grouped by shape, so that batches stay full, and
        # the first cache is decoded at once: its answer drafts the others'.
        window = batch_size if self.step_by_step else 4 * batch_size
        order = sorted(range(len(presses)), key=lambda i: _press_sort_key(presses[i]))
        for n, i in enumerate(order):
            cache = self.compressed_cache(state, presses[i])
            masks = self.masks(state, presses[i])
            fp = (cache_fingerprint(state, cache), _mask_fingerprint(masks))
            built[i] = (cache, masks, fp)
            signature = cache_signature(cache)
            if fp not in decoded and all(fp != built[j][2] for j in waiting.get(signature, [])):
                waiting.setdefault(signature, []).append(i)
                if len(waiting[signature]) == batch_size or (not self.step_by_step and draft_key not in state.memo):
                    decode(waiting.pop(signature))
            if self.step_by_step and (n + 1) % batch_size == 0:
                while waiting:
                    decode(waiting.pop(next(iter(waiting))))
            elif len(built) >= window and waiting:
                decode(waiting.pop(max(waiting, key=lambda k: len(waiting[k]))))
            finish()
        while waiting:
            decode(waiting.pop(next(iter(waiting))))
        return out

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


@contextlib.contextmanager
def _shared_scores(press, state: Prefill):
    """While ``press`` compresses ``state``, its scorer's scores of a whole recorded layer are computed once per
    prefill and scorer configuration and reused (they depend on neither the ratio nor the grid offset): SnapKV,
    expected-attention and the like cost more than the compression itself, and a sweep compresses one context at
    every ratio, stride and offset. Scores of parts of a layer (kvpress's chunk presses) and random scores are not
    shared."""
    from kvpress import ScorerPress

    from kvpress_phase.presses import WindowedPress

    scorer = press.scorer if isinstance(press, WindowedPress) else press
    if (not isinstance(scorer, ScorerPress) or type(scorer).__name__ == "RandomPress" or "score" in vars(scorer)
            or getattr(scorer, "needs_context", False)):  # KVzipScorer: its scores are already per prefill
        yield
        return
    settings = tuple((f.name, repr(getattr(scorer, f.name))) for f in dataclasses.fields(scorer)
                     if f.name != "compression_ratio" and f.compare)
    memo = state.memo.setdefault("scores", {})
    recorded = {id(entry[2]): layer for layer, entry in state.inputs.items()}
    original = scorer.score

    def score(module, hidden_states, keys, values, attentions, kwargs):
        layer = recorded.get(id(keys))
        if layer is None or state.inputs[layer][2] is not keys:  # a part of a layer: not shared
            return original(module, hidden_states, keys, values, attentions, kwargs)
        key = (type(scorer).__name__, settings, layer)
        if key not in memo:
            memo[key] = original(module, hidden_states, keys, values, attentions, kwargs)
        return memo[key].clone()  # a press may work on its scores in place

    scorer.score = score
    try:
        yield
    finally:
        del scorer.score


def _is_kvzip(press) -> bool:
    from kvpress import KVzipPress

    return isinstance(press, KVzipPress)


def _mask_fingerprint(masks) -> tuple:
    if not masks:
        return ()
    return tuple((layer, int(h.numel()), int((h.long() * 100003 + s.long()).sum())) for layer, (h, s) in
                 sorted(masks.items()))


def _attended_length(cache, masks) -> float:
    """Mean over layers and KV heads of the cache entries decoding attends to (masked entries not counted)."""
    total, slots = 0, 0
    for idx, layer in enumerate(cache.layers):
        batch, heads, n = layer.keys.shape[:3]
        total += batch * heads * n - (int(masks[idx][0].numel()) if masks and idx in masks else 0)
        slots += batch * heads
    return total / max(slots, 1)


def _press_sort_key(press) -> tuple:
    """Order in which presses are compressed and decoded: presses of one ratio together (equal cache shapes)."""
    return (float(getattr(press, "compression_ratio", 0.0) or 0.0), type(press).__name__)


# ------------------------------------------------------------------------------------------------ shards
class ShardWarning(UserWarning):
    """Lines of a results shard that hold no record (skipped), or a torn last line cut off by a resume."""


def _parse_record(raw: bytes) -> Optional[dict]:
    """The record on one shard line: a JSON object with a ``key``; None for anything else."""
    try:
        record = json.loads(raw)
    except ValueError:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        return None
    return record if isinstance(record, dict) and isinstance(record.get("key"), str) else None


def _read_shard(path: str, *, resume: bool = False) -> list[dict]:
    """The records of a JSONL shard: every line that holds a JSON object with a ``key``.

    Any other line (not JSON, not an object, no key) is skipped, and the file's skipped lines are named by path
    and line number in one :class:`ShardWarning`; every valid record before and after them is used. Blank lines are
    ignored. Only the last line can lack its newline (a write cut short by a crash, or a copy cut at some byte):

    - ``resume=False`` (reading, as ``read_results`` and ``kvpress-phase report`` do) never changes the file: such a
      last line is a record when it holds a complete JSON object with a key, and skipped (and named) otherwise.
    - ``resume=True`` (a run resuming into its own shard, under the shard's lock) treats such a line as a torn
      write whatever it holds: it is cut off the file and appended to ``<path>.cut`` (a warning says so), and its
      example is computed again. This is the only change ever made to a shard: other unreadable lines stay where
      they are, and the shard ends with a newline, so the records appended next start on a line of their own.
    """
    if not os.path.exists(path):
        return []
    records, skipped, torn, size = [], [], None, 0
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            if resume and not raw.endswith(b"\n"):
                torn = number, raw
                break
            size += len(raw)
            record = _parse_record(raw)
            if record is not None:
                records.append(record)
            elif raw.strip():
                last = "" if raw.endswith(b"\n") else ": the last, with no newline, a write cut short or under way"
                skipped.append(f"{number}{last}")
    if torn is not None:
        number, raw = torn
        with open(path + ".cut", "ab") as cut:  # kept, never lost: appended to what earlier resumes cut
            cut.write(raw + b"\n")
        with open(path, "r+b") as fh:
            fh.truncate(size)
        warnings.warn(f"{path}: line {number} is a torn write (no newline at the end of the file); moved to "
                      f"{path}.cut, its example is run again", ShardWarning, stacklevel=2)
    if skipped:
        named = ", ".join(skipped[:20])
        named += f" and {len(skipped) - 20} more" if len(skipped) > 20 else ""
        lines = "lines" if len(skipped) > 1 else "line"
        warnings.warn(f"{path}: skipped {len(skipped)} unreadable {lines} ({lines} {named}); the file is left as it is",
                      ShardWarning, stacklevel=2)
    return records


def record_key(record: dict) -> str:
    fields = ("task", "context_length", "stride", "window", "protocol", "sample_id", "phase", "press",
              "compression_ratio")
    key = "|".join(str(record[f]) for f in fields)
    setting = record.get("setting", SETTINGS[False])
    return key if setting == SETTINGS[False] else f"{key}|{setting}"  # keys of earlier runs stay valid


def read_results(output_dir: str) -> pd.DataFrame:
    """All shards of a run, deduplicated by example key and sorted deterministically.

    Read only: the shards are never changed. A line that holds no record is skipped with a :class:`ShardWarning`
    naming the file and line (see :func:`_read_shard` for the rule on a last line without a newline).
    """
    folder = os.path.join(output_dir, RESULTS_DIR)
    records = []
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".jsonl"):
                records.extend(_read_shard(os.path.join(folder, name)))
    if not records:
        return pd.DataFrame()
    df = pd.DataFrame(records).drop_duplicates("key", keep="first")
    if "setting" not in df:
        df["setting"] = SETTINGS[False]
    df["setting"] = df["setting"].fillna(SETTINGS[False])  # runs from before the setting existed
    order = ["task", "context_length", "stride", "window_sort", "protocol", "setting", "sample_id", "phase",
             "press", "compression_ratio"]
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


@contextlib.contextmanager
def removed_if_failed_empty(output_dir: str, rank: int = 0):
    """Undo what a failed run created in ``output_dir`` when it wrote no result (e.g. a model that fails to load).

    Entered before anything is created. When the block raises and no file in ``results/`` holds data, the shard's
    lock file, ``config.json`` (rank 0), an empty shard, ``results/``, ``output_dir`` and the parent folders made for
    it are removed, each only if it was not there when the block was entered and a folder only when empty. The
    removal holds the shard's lock; when another run holds it, nothing is removed.
    """
    results = os.path.join(output_dir, RESULTS_DIR)
    ours = [os.path.join(results, f"results-rank{rank}.jsonl"), lock_path(output_dir, rank)]
    ours += [os.path.join(output_dir, "config.json")] if rank == 0 else []
    ours += [results, output_dir]  # folders last, after the files in them, and the parents made for output_dir
    parent = os.path.dirname(os.path.abspath(output_dir))
    while not os.path.lexists(parent):
        ours.append(parent)
        parent = os.path.dirname(parent)
    created = [path for path in ours if not os.path.lexists(path)]
    try:
        yield
    except BaseException:
        wrote = os.path.isdir(results) and any(os.path.getsize(os.path.join(results, name))
                                               for name in os.listdir(results))
        if created and not wrote:
            with contextlib.suppress(OutputDirInUse, OSError), output_lock(output_dir, rank):
                for path in created:
                    with contextlib.suppress(OSError):  # a folder that is not empty stays
                        os.rmdir(path) if os.path.isdir(path) else os.remove(path)
        raise


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
        if not config.resumes(previous.get("fingerprint")):
            raise ValueError(
                f"output directory {output_dir!r} holds results of a different configuration; "
                "use another --output-dir or the same arguments to resume"
            )
    elif rank == 0:
        with open(config_path, "w") as fh:
            json.dump(saved, fh, indent=2)

    shard_path = os.path.join(output_dir, RESULTS_DIR, f"results-rank{rank}.jsonl")
    done = {r["key"] for r in _read_shard(shard_path, resume=True)}  # cuts a torn last line into <shard>.cut
    units = plan_units(config, tokenizer)
    if config.protocol == "offset":  # the same text at every stride: the strides of a sample share one prefill
        units = sorted(units, key=lambda u: (u.task, u.context_length, u.sample_id))
    units = units[rank::world]
    engine = ReplayEngine(model, tokenizer, offload=offload, step_by_step=config.step_by_step)
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


def prefill_prompt(row: dict, compress_question: bool) -> tuple[str, str]:
    """``(context, question)`` as handed to the pipeline: with ``compress_question`` the question is appended to the
    context (compressed with it) and the question left empty, as kvpress's evaluation does (``compress_questions``);
    the answer is decoded after the chat template's question suffix and the answer prefix."""
    if compress_question:
        return row["context"] + row["question"], ""
    return row["context"], row["question"]


def _run_unit(engine, config, unit, unit_variants, done, shard, bar):
    """Answer every (row, variant) of ``unit`` not yet in ``done``, appending one record per answer to ``shard``.

    Rows that share a prompt share one prefill, and every distinct compressed cache of the prompt is decoded once
    (:meth:`ReplayEngine.answer_many`, in batches of ``config.decode_batch``): a variant that does not depend on the
    row (a press without a grid offset) is answered once per prompt, and variants whose caches are equal share their
    answer. The uncompressed reference of the diagnostic comes from the ``no_press`` variant's decoding when there
    is one, else from one question forward.
    """
    from .diagnostics import needle_mass

    # what the unit's presses read decides what the prefill records (offsets do not change it)
    reads_of = [build_press(spec, ratio, unit.stride, window, 0) for spec, ratio, window in unit_variants]
    setting = SETTINGS[config.compress_question]
    prompts: dict[tuple, list] = {}
    for row in unit.rows:
        context, question = prefill_prompt(row, config.compress_question)
        prompts.setdefault((context, question, row["answer_prefix"], row["max_new_tokens"]), []).append(row)
    for prompt, rows in prompts.items():
        pending = []
        for row in rows:
            for spec, ratio, window in unit_variants:
                record = {
                    "task": unit.task, "context_length": unit.context_length, "stride": unit.stride,
                    "window": window, "protocol": row["protocol"], "sample_id": row["sample_id"],
                    "phase": row["phase"], "press": spec.label, "compression_ratio": ratio, "setting": setting,
                }
                record["key"] = record_key(record)
                if record["key"] in done:
                    bar.update(1)
                else:
                    pending.append((row, spec, ratio, window, record))
        if not pending:
            continue
        context, question, answer_prefix, max_new_tokens = prompt
        encoded = engine.encode(context, [question], answer_prefix)
        if config.compress_question:
            _check_question_appended(engine, rows[0], encoded)
        state = engine.shared_prefill(encoded["context_ids"], presses=reads_of)
        question_ids = encoded["questions_ids"][0]
        needles = sorted({(row["needle_token_start"], row["needle_token_end"]) for row, *_ in pending})
        jobs: dict[tuple, int] = {}
        presses = []
        for row, spec, ratio, window, record in pending:
            offset = row["offset"] if spec.name in PHASE_GRID_PRESSES else 0
            job = (spec.label, ratio, window, offset)
            if job not in jobs:
                jobs[job] = len(presses)
                presses.append(build_press(spec, ratio, unit.stride, window, offset,
                                           matched_context_length=state.context_length if config.matched_cache
                                           else None))
        answers = engine.answer_many(state, presses, question_ids, max_new_tokens,
                                     needles=needles if config.diagnostics else None,
                                     batch_size=config.decode_batch)
        full_masses: dict = {}
        if config.diagnostics:
            plain = [i for i, p in enumerate(presses) if p is None]
            if plain:
                full_masses = dict(zip(needles, answers[plain[0]]["masses"]))
            else:  # no uncompressed variant run for this prompt: one question forward
                att, cache = engine.attention_rows(state, None, question_ids)
                full_masses = {n: needle_mass(att, state, None, cache, n, question_ids.shape[1]) for n in needles}
        for row, spec, ratio, window, record in pending:
            offset = row["offset"] if spec.name in PHASE_GRID_PRESSES else 0
            i = jobs[(spec.label, ratio, window, offset)]
            press, result = presses[i], answers[i]
            needle = (row["needle_token_start"], row["needle_token_end"])
            mass = result["masses"][needles.index(needle)] if result["masses"] is not None else None
            full_mass = full_masses.get(needle)
            cache_len = result["cache_length"]
            record.update({
                "offset": row["offset"], "seed": row["seed"], "depth": row["depth"],
                "context_tokens": row["context_length"], "prefill_tokens": state.context_length,
                "answer_token_start": row["answer_token_start"],
                "answer": list(row["answer"]), "prediction": result["prediction"],
                "score": score(result["prediction"], row["answer"], unit.task),
                "cache_length": round(cache_len, 2) if cache_len != int(cache_len) else int(cache_len),
                "press_ratio": getattr(press, "compression_ratio", 0.0) if press is not None else 0.0,
                "window_ratio": getattr(press, "window_ratio", None),
                "achieved_ratio": round(1.0 - cache_len / state.context_length, 6),
                "needle_attention": mass,
                "needle_attention_ratio": (mass / full_mass) if mass is not None and full_mass else None,
            })
            shard.write(json.dumps(record) + "\n")
            shard.flush()
            done.add(record["key"])
            bar.update(1)


def _check_question_appended(engine, row: dict, encoded: dict) -> None:
    """With the question compressed, the context's tokens must open the prefill unchanged (positions and phases are
    those of the context alone); ValueError naming the task otherwise."""
    alone = engine.encode(row["context"], [row["question"]], row["answer_prefix"])["context_ids"]
    end = min(alone.shape[1], row["needle_token_end"] + 1)
    if not torch.equal(alone[0, :end], encoded["context_ids"][0, :end]):
        raise ValueError(f"task {row['task']!r}: appending the question changes the context's tokens before the "
                         "needle, so --compress-question would move the needle off its phase")
