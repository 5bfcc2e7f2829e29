"""Prefill once, replay every compression: the recorded prefill and the engine that compresses and decodes it.

kvpress compression changes only the cache, so a context is prefilled once with a capturing press that records, for
every hooked attention layer, the arguments kvpress would hand to ``press.compress`` (only the optional inputs the
presses under test read, :func:`.presses.prefill_reads`; on the CPU with ``offload="cpu"``). :class:`ReplayEngine` applies any
press to the recorded inputs and decodes the questions over the compressed caches, once per distinct cache
(:func:`cache_fingerprint`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
from kvpress import BasePress, KVPressTextGenerationPipeline

from .prefill_inputs import ATTENTIONS, HIDDEN_STATES

ALL_INPUTS = frozenset({HIDDEN_STATES, ATTENTIONS})
OFFLOAD_CHOICES = (None, "cpu")


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
class KVzipMasks:
    """kvpress's ``KVzipPress`` as the evaluation replays it (the registry's ``kvzip`` and ``kvzip_plus`` build this):
    the full cache, decoded with the entries ``KVzipPress(compression_ratio, kvzip_plus_normalization=...)`` masks.
    Its scores come from reconstructing the whole context (:func:`~kvpress_phase.presses.kvzip_adapter.kvzip_scores`,
    once per prefill and variant) and its masks from kvpress's own global eviction rule
    (:func:`~kvpress_phase.presses.kvzip_adapter.kvzip_masks`), so a sweep scores a context once for every ratio."""

    compression_ratio: float = 0.0
    kvzip_plus_normalization: bool = False

    def post_init_from_model(self, model) -> None:
        """Nothing to load (kvpress's press is built when the masks are)."""


@dataclass
class KVgradMasks(KVzipMasks):
    """kvpress's ``KVgradPress`` as the evaluation replays it (the registry's ``kvgrad``), as :class:`KVzipMasks`
    replays ``KVzipPress``: the full cache, decoded with the entries ``KVgradPress(compression_ratio)`` masks. Its
    scores (KVzip's reconstruction of the context with one backward pass per chunk: :func:`~kvpress_phase.presses.kvzip_adapter.kvgrad_scores`) are
    computed once per prefill, and its masks come from the eviction rule it inherits from ``KVzipPress``
    (:func:`~kvpress_phase.presses.kvzip_adapter.kvzip_masks`)."""

    kvzip_plus_normalization: bool = field(default=False, init=False)


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
    layer's uncompressed keys and values at a time and the compressed cache being decoded (see docs/evaluation.md, memory
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
        """The pipeline's ``context_ids`` and ``questions_ids``; ValueError for a prefill longer than the tokenizer's
        ``model_max_length``, which the pipeline would cut there (perhaps past the needle) without a word."""
        from .prompting import context_limit

        encoded = self.pipe.preprocess(context, questions, answer_prefix, int(1e10))  # never cut: refused below
        limit, length = context_limit(self.tokenizer), encoded["context_ids"].shape[1]
        if limit is not None and length > limit:
            raise ValueError(f"a prefill of {length} tokens exceeds the tokenizer's model_max_length ({limit}), where "
                             "kvpress's pipeline would cut it (and perhaps the needle); use shorter context lengths")
        return encoded

    def shared_prefill(self, context_ids: torch.Tensor, reads: Optional[Iterable] = None) -> Prefill:
        """:meth:`prefill`, reusing the last prefill when it was of the same tokens and recorded ``reads`` (the offset protocol's text does not depend on the stride, so a sweep over strides prefills, scores and
        decodes the uncompressed control once per context). One prefill is kept."""
        reads = ALL_INPUTS if reads is None else frozenset(reads)
        last = getattr(self, "_last_prefill", None)
        if last is not None and reads <= last.reads and torch.equal(last.context_ids, context_ids):
            return last
        self._last_prefill = None  # free it before the next prefill
        self._last_prefill = self.prefill(context_ids, reads)
        return self._last_prefill

    @torch.inference_mode()
    def prefill(self, context_ids: torch.Tensor, reads: Optional[Iterable] = None) -> Prefill:
        """Prefill ``context_ids`` and record the optional compress inputs ``reads`` (a subset of
        ``{"hidden_states", "attentions"}``, what the presses to replay read: :func:`.presses.prefill_reads`; all of
        them when None). Keys, values and the layers' kwargs are always recorded."""
        from transformers import DynamicCache

        reads = ALL_INPUTS if reads is None else frozenset(reads)
        capture = _CapturePress(reads=reads, offload=self.offload)
        cache = DynamicCache()
        with capture(self.model):
            self.model.model(input_ids=context_ids.to(self.model.device), past_key_values=cache)
        return Prefill(context_ids.shape[1], cache, capture.inputs, reads, self.offload, context_ids=context_ids)

    @torch.inference_mode()
    def compressed_cache(self, state: Prefill, press: Optional[BasePress], *, share_scores: bool = False):
        """A cache holding ``press``'s compression of ``state`` (the original tensors are not modified).

        With ``share_scores`` (what the press's registry entry allows: :func:`.presses.shares_scores`), the scores
        of each whole layer are computed once per prefill and reused by every later press that shares them.

        For :class:`KVzipMasks` (kvpress's ``KVzipPress``, which masks instead of removing) the cache is the full one;
        its masks are :meth:`masks`."""
        if isinstance(press, KVzipMasks):
            return self.compressed_cache(state, None)
        cache = copy.copy(state.cache)
        cache.layers = [copy.copy(layer) for layer in state.cache.layers]
        if press is None and state.offload is None:
            return cache
        if press is not None:
            press.post_init_from_model(self.model)
            scorer = getattr(press, "scorer", None)
            if getattr(scorer, "needs_context", False):  # KVzipScorer: once per prefill
                scorer.scores = self._kvzip_scores(state, scorer.kvzip_plus_normalization)
        device = self.model.device
        missing = ALL_INPUTS - state.reads
        left = state.memo.setdefault("left_masks", {})
        # kept with the prefill (the press itself is not kept alive by it): the masks this press left
        left[id(press)] = (weakref.ref(press) if press is not None else None, {})
        try:
            with _shared_scores(press, state, share_scores):
                if getattr(press, "plans_across_layers", False):  # a budget across layers: every layer's scores
                    press.plan(state.inputs.values())
                self._compress_layers(state, press, cache, device, left[id(press)][1])
        except (RuntimeError, NotImplementedError) as exc:
            if not missing or "meta" not in str(exc):
                raise
            raise ValueError(
                f"{type(press).__name__} reads what this prefill did not record ({', '.join(sorted(missing))}); "
                "prefill with reads= including it (evaluation.presses.prefill_reads gives a press spec's)"
            ) from exc
        return cache

    def _compress_layers(self, state: Prefill, press, cache, device, masks: dict) -> None:
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
                # a press that masks entries (per-KV-head budgets: AdaKV, ours) leaves them for kvpress's attention
                # patch; the engine keeps them and decodes with masks of its own (:meth:`masks`)
                found = getattr(module, "masked_key_indices", None)
                if found is not None:
                    _, heads, seqs = found
                    masks[layer_idx] = (heads.clone(), seqs.clone())
                module.masked_key_indices = None
            cache.layers[layer_idx].keys = new_keys
            cache.layers[layer_idx].values = new_values

    def masks(self, state: Prefill, press: Optional[BasePress]):
        """The entries ``press`` masks in ``state``'s cache while decoding (:data:`.decoding.Masks`), or None for
        a press that removes entries. KVzip's scores are computed once per prefill and reused for every ratio; a
        press that masks per KV head while compressing (kvpress's ``AdaKVPress``, a per-head budget wrapper of ours)
        leaves its masks in kvpress's ``module.masked_key_indices``, which :meth:`compressed_cache` keeps, so this is
        called after that."""
        if not isinstance(press, KVzipMasks):
            found = state.memo.get("left_masks", {}).get(id(press))
            alive = found is not None and found[0] is not None and found[0]() is press
            return (found[1] or None) if alive else None
        if press.compression_ratio == 0:
            return None
        from kvpress_phase.presses.kvzip_adapter import kvzip_masks  # looked up per call: benchmarks time it
        scores = self._kvgrad_scores(state) if isinstance(press, KVgradMasks) else \
            self._kvzip_scores(state, press.kvzip_plus_normalization)
        return kvzip_masks(self.model, scores, press.compression_ratio)

    def _kvgrad_scores(self, state: Prefill) -> torch.Tensor:
        """KVgrad's scores of ``state``'s context (:func:`~kvpress_phase.presses.kvzip_adapter.kvgrad_scores`), computed once per prefill for every ratio."""
        if "kvgrad_scores" not in state.memo:
            from kvpress_phase.presses.kvzip_adapter import kvgrad_scores

            state.memo["kvgrad_scores"] = kvgrad_scores(self.model, state.context_ids, self.tokenizer)
        return state.memo["kvgrad_scores"]

    def _kvzip_scores(self, state: Prefill, plus: bool = False) -> torch.Tensor:
        """KVzip's (or, with ``plus``, KVzip+'s) reconstruction scores of ``state``'s context, computed once per
        prefill (they serve kvpress's ``KVzipPress`` at every ratio and our presses' ``KVzipScorer``)."""
        from kvpress_phase.presses.kvzip_adapter import kvzip_scores

        if state.offload is not None:
            raise ValueError("KVzip replays the context over the full cache, which offload='cpu' does not keep")
        key = ("kvzip_scores", plus)
        if key not in state.memo:
            state.memo[key] = kvzip_scores(self.model, state.context_ids, state.cache, self.tokenizer, plus=plus)
        return state.memo[key]

    @torch.inference_mode()
    def answer_many(self, state: Prefill, presses: list, question_ids: torch.Tensor, max_new_tokens: int, *,
                    needles: Optional[list] = None, batch_size: int = 16,
                    share_scores: Optional[list] = None,
                    on_answer: Optional[Callable[[int], None]] = None) -> list[dict]:
        """Greedy answers to one question under every press of ``presses``, decoded in batches.

        Presses whose compressed caches are equal are decoded once (:func:`cache_fingerprint`, masks included);
        caches of equal shapes are decoded together, up to ``batch_size`` at a time (:func:`.decoding.decode_tokens`,
        the first answer drafting the others unless the engine decodes step by step; ``batch_size=1`` step by step
        gives exactly the pipeline's answers). With ``needles`` (a list of token spans), the
        needle-attention diagnostic of every press for every span is taken from the answer's first decoding step.
        ``share_scores``: per press, whether its scores may be shared (:meth:`compressed_cache`; none when None).
        ``on_answer``: called with a press's index as soon as its answer is known (a progress bar's hook).
        Returns, per press: ``prediction``, ``cache_length`` (mean entries per layer and KV head that decoding
        attends to), ``cache_bytes`` (the bytes the cache holds after the prefill as kvpress's pipeline stores it,
        measured: :func:`kvpress_phase.cache_bytes`; a per-head press of ours on its ragged cache, :func:`ragged_cache`,
        which it is also decoded on, one answer at a time, checking the first answer as a draft unless step by step; its
        needle diagnostic is read from one masked forward of the
        question over the same entries),
        ``masses`` (one per needle, or None).
        """
        from kvpress_phase.ragged import cache_bytes

        from .decoding import answer_text, cache_signature, decode_ragged, decode_tokens
        from .diagnostics import AttentionProbe, needle_mass

        out: list = [None] * len(presses)
        # fingerprint -> (prediction, rows), kept with the prefill for every question asked of it
        question_key = (tuple(question_ids[0].tolist()), max_new_tokens)
        decoded = state.memo.setdefault(("decoded", *question_key, bool(needles)), {})
        draft_key = ("draft", *question_key)
        q_len = question_ids.shape[1]
        built: dict = {}  # press index -> (cache, masks, fingerprint, bytes stored), until its answer is known
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
                cache, masks, fp, nbytes = built.pop(i)
                prediction, rows = decoded[fp]
                masses = None
                if needles:
                    masses = [needle_mass(rows, state, presses[i], cache, needle, q_len) for needle in needles]
                out[i] = {"prediction": prediction, "cache_length": _attended_length(cache, masks),
                          "cache_bytes": nbytes,
                          "masses": masses}
                if on_answer is not None:
                    on_answer(i)

        # Step by step, the presses are decoded in consecutive chunks of batch_size, each chunk's caches grouped by
        # shape. Otherwise up to 4 * batch_size caches wait to be grouped by shape, so that batches stay full, and
        # the first cache is decoded at once: its answer drafts the others'.
        window = batch_size if self.step_by_step else 4 * batch_size
        order = sorted(range(len(presses)), key=lambda i: _press_sort_key(presses[i]))
        for n, i in enumerate(order):
            cache = self.compressed_cache(state, presses[i], share_scores=bool(share_scores and share_scores[i]))
            masks = self.masks(state, presses[i])
            fp = (cache_fingerprint(state, cache), _mask_fingerprint(masks))
            if stores_ragged(presses[i]) and masks:
                # stored and decoded as kvpress's pipeline stores and decodes it: each KV head its own entries
                stored = ragged_cache(cache, masks)
                built[i] = (cache, masks, fp, cache_bytes(stored))
                if fp not in decoded:
                    tokens = decode_ragged(self.model, stored, question_ids, state.context_length, max_new_tokens,
                                           draft=None if self.step_by_step else state.memo.get(draft_key))
                    own = None
                    if needles:  # the question's attention over the same entries, read from the masked layout
                        rows = {}
                        decode_tokens(self.model, [cache], question_ids, state.context_length, 1, masks=[masks],
                                      probe=AttentionProbe(self.model, state.inputs, rows), step_by_step=True)
                        own = {layer: torch.cat([r[:, :, :cache.layers[layer].keys.shape[2]],
                                                 r[:, :, r.shape[-1] - q_len:]], dim=-1) for layer, r in rows.items()}
                    decoded[fp] = (answer_text(self.tokenizer, tokens), own)
                del stored
                finish()
                continue
            built[i] = (cache, masks, fp, cache_bytes(cache))
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
def _shared_scores(press, state: Prefill, share: bool):
    """While ``press`` compresses ``state``, with ``share`` (its registry entry's decision,
    :func:`.presses.shares_scores`), its scorer's scores of a whole recorded layer are computed once per prefill and
    scorer configuration and reused (they depend on neither the ratio nor the grid offset): SnapKV,
    expected-attention and the like cost more than the compression itself, and a sweep compresses one context at
    every ratio, stride and offset. Scores of parts of a layer are not shared."""
    scorer = getattr(press, "scorer", press)  # ours hold a scorer; kvpress's scorer presses are their own
    if not share or press is None or "score" in vars(scorer):
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
        key = (type(scorer), settings, layer)
        if key not in memo:
            memo[key] = original(module, hidden_states, keys, values, attentions, kwargs)
        return memo[key].clone()  # a press may work on its scores in place

    scorer.score = score
    try:
        yield
    finally:
        del scorer.score


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


def stores_ragged(press) -> bool:
    """Whether ``press``, used through kvpress's pipeline, stores layers whose KV heads keep different numbers of
    entries ragged (our per-head budget wrappers, :mod:`kvpress_phase.presses.storage`) rather than masked (kvpress's
    per-head presses)."""
    return bool(getattr(press, "per_head", False))


def ragged_cache(cache, masks):
    """``cache`` (a replayed compressed cache) as kvpress's pipeline stores it for a press that :func:`stores_ragged`:
    every layer with masked entries written by :func:`kvpress_phase.presses.storage.store_layer` (each KV head only its
    own entries), the other layers shared with ``cache``. The one storage path of the pipeline and the replay."""
    from transformers import DynamicCache

    from kvpress_phase.presses.storage import store_layer

    out = DynamicCache()
    out.layers = [copy.copy(layer) for layer in cache.layers]
    for idx, (heads, seqs) in (masks or {}).items():
        layer = cache.layers[idx]
        keep = torch.ones(layer.keys.shape[1], layer.keys.shape[2], dtype=torch.bool, device=layer.keys.device)
        keep[heads.to(keep.device), seqs.to(keep.device)] = False
        store_layer(out, idx, layer.keys, layer.values, keep, seq_length=layer.keys.shape[2])
    return out


def _press_sort_key(press) -> tuple:
    """Order in which presses are compressed and decoded: presses of one ratio together (equal cache shapes)."""
    return (float(getattr(press, "compression_ratio", 0.0) or 0.0), type(press).__name__)
