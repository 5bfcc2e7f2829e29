"""The press registry: one :class:`PressEntry` per press the evaluation can run, ours and kvpress's baselines, and
:func:`build_press`, which builds a press from its entry.

Everything the evaluation knows about a press is its entry in :data:`REGISTRY`: its description (the CLI's
``list``), its factory, what its scores read (the prefill records only that; the question, when it is compressed
with the context), whether it masks entries instead of removing them, whether the offset protocol moves its grid,
and whether ``--matched-cache`` runs it at the ratio that matches ``ChunkedStridePress``'s cache length. The runner,
the CLI, the reports and the training configuration read these entries, never a class name. Specs (a name and its
``:key=value`` settings) are parsed in :mod:`.presses`; their spellings, today's and former, are
:mod:`.spellings`'.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from .prefill_inputs import ATTENTIONS, HIDDEN_STATES, QUESTION
from .spellings import WRAPPED, WRAPPERS

if TYPE_CHECKING:  # presses imports this module
    from .presses import PressSpec


@dataclass(frozen=True)
class BuildArgs:
    """What the runner hands a factory: the nominal ratio, the ratio a kvpress baseline runs at (the matched one
    under ``--matched-cache``), the stride, the window (None: the press's default) and the grid offset."""

    ratio: float
    base_ratio: float
    stride: int
    window: Optional[int]
    offset: int


@dataclass(frozen=True)
class PressEntry:
    """One press the evaluation can run."""

    name: str
    description: str
    factory: Callable[[dict, BuildArgs], object]
    """``factory(settings, args)``: the press (None for no compression)."""
    reads: frozenset = frozenset()
    """Optional compress inputs its scores read (:data:`HIDDEN_STATES`, :data:`ATTENTIONS`); keys, values and the
    layer's kwargs always are. :data:`QUESTION`: the scores read the last prefill tokens, so the question when it is
    compressed with the context."""
    settings: str = "none"
    """``"fields"`` (any field of the press), ``"scorer"`` (``scorer=NAME``, a name of :attr:`scorers`) or ``"none"``."""
    masks: bool = False
    """It keeps every entry and masks the evicted ones while decoding (its cache length is the unmasked entries)."""
    grid_offset: bool = False
    """Its window grid has an offset, which the offset protocol moves."""
    matched: bool = False
    """``--matched-cache`` runs it at the ratio that gives ``ChunkedStridePress``'s cache length."""
    default_scorer: Optional[str] = None
    """The scorer a chunk wrapper wraps unless ``scorer=`` names another."""
    in_default_job: bool = True
    """``kvpress-phase eval`` with no ``--presses`` runs it (not: the studies' ablations, and presses that need
    something only some models have, such as a shipped scorer)."""
    scorers: Optional[tuple] = None
    """``"scorer"`` settings: the scorer names ``scorer=`` accepts (None: :data:`CHUNK_SCORERS`)."""
    chunk_scorer: bool = False
    """kvpress's chunk wrappers (``chunk:scorer=NAME``) accept it as their scorer (a press that scores every entry of
    a chunk on its own: not KVzip, which scores whole contexts, nor random scores, which are no baseline)."""
    trainable: bool = False
    """A model can be fine-tuned with it in the loop (``kvpress-phase train --press``)."""
    shared_scores: bool = False
    """Its scores of a whole layer depend on the prefill alone (not on the ratio, the stride or the grid offset), so
    the replay engine computes them once per prefill and reuses them, for the press itself and for ours when it is
    their ``scorer=`` (:func:`shares_scores`). Not: random scores, and KVzip's, which are already per prefill."""
    setting_names: Optional[Callable[[dict], tuple]] = None
    """``setting_names(settings)``: the keys a ``"fields"`` press's spec may set, given the spec's settings (see
    :func:`press_settings`)."""
    wraps: Optional[str] = None
    """The registry name of the press a wrapper wraps (its spec takes that press's settings besides its own)."""
    example: Optional[str] = None
    """A spec with settings that ``kvpress-phase list`` shows (None: the name, or ``scorer=`` its first other
    scorer; :func:`example_spec`)."""
    overlapping_windows: Optional[Callable[[dict], bool]] = None
    """``overlapping_windows(settings)``: whether the press, with these settings, takes windows longer than its
    stride (``--windows`` W > S). One that does not (None: never) runs at W = S on the strides shorter than a
    ``--windows`` value (:func:`~.config.windows_at`)."""


RUN_SETTINGS = {"compression_ratio": "--compression-ratios", "stride": "--strides",
                "offset": "--protocol (the grid offset)", "window": "--windows"}
"""Fields of our presses that the run sets (from the flag named), never a press spec; ``window`` is a setting of the
presses whose factory takes one from the spec (:func:`press_settings`)."""


def _fields(class_name: str, *extra: str, window: bool = False):
    """``setting_names`` of a press built from ``class_name``'s fields: its init fields but the run's
    (:data:`RUN_SETTINGS`; ``window`` too unless ``window``), and the factory's ``extra`` keys."""
    def names(options: dict) -> tuple:
        import dataclasses

        import kvpress_phase
        import kvpress_phase.presses.ablations

        run = set(RUN_SETTINGS) - ({"window"} if window else set())
        own = [f.name for f in dataclasses.fields(getattr(kvpress_phase, class_name))
               if f.init and not f.name.startswith("_") and f.name not in run]
        return tuple(dict.fromkeys(own + list(extra)))
    return names


def _phase_aware_settings(options: dict) -> tuple:
    """``phase_aware``'s settings: ``PhaseAwarePress``'s fields, and ``window`` (equal to the stride: the press has
    no windows)."""
    return _fields("PhaseAwarePress", "window")(options)


def _wrapper_fields(name: str) -> tuple:
    """The init fields of the budget wrapper ``name`` other than the press it wraps (``floor``; ``threshold`` for
    ``threshold_budget``)."""
    import dataclasses

    return tuple(f.name for f in dataclasses.fields(_wrapper_class(name))
                 if f.init and f.name != "press" and not f.name.startswith("_"))


def _wrapper_settings(name: str):
    """``setting_names`` of the budget wrapper ``name``: its own fields and ``press``
    (:data:`~.spellings.WRAPPED`), then the settings of the ``PhaseAwarePress`` it wraps."""
    def names(options: dict) -> tuple:
        return _wrapper_fields(name) + ("press",) + _phase_aware_settings(options)
    return names


def _chunked_stride(options: dict, a: BuildArgs):
    from kvpress_phase import ChunkedStridePress

    return ChunkedStridePress(a.ratio, stride=a.stride, window=a.window or a.stride, offset=a.offset, **options)


def _staggered_window(options: dict, a: BuildArgs):
    from kvpress_phase import StaggeredWindowPress

    window = {"window": a.window} if a.window else {}
    return StaggeredWindowPress(a.ratio, stride=a.stride, offset=a.offset, **window, **options)


def _phase_aware(options: dict, a: BuildArgs):
    from kvpress_phase import PhaseAwarePress

    options = dict(options)
    window = options.pop("window", None) or a.window
    if window and window != a.stride:
        raise ValueError(f"window ({window}) must equal stride ({a.stride}) for PhaseAwarePress, whose choice has no "
                         "windows; overlapping windows are StaggeredWindowPress's (staggered_window)")
    return PhaseAwarePress(a.ratio, stride=a.stride, offset=a.offset, **options)


def _wrapper_class(name: str):
    """The class of the budget wrapper ``name``: a press of the package, or a retired one of its ablations."""
    import kvpress_phase
    from kvpress_phase.presses import ablations

    return getattr(kvpress_phase, WRAPPERS[name], None) or getattr(ablations, WRAPPERS[name])


def _budget(name: str):
    """The budget wrapper ``name`` (:data:`~.spellings.WRAPPERS`) around the ``PhaseAwarePress`` of the other
    settings, or around the kvpress scorer press ``press=NAME`` names (``global_budget:press=knorm`` is
    ``GlobalBudgetPress(KnormPress(ratio))``, at the nominal ratio: the wrapper spends kvpress's own budget); the
    wrapper's own fields (``floor``, and ``threshold`` for ``threshold_budget``) are the wrapper's."""
    def build(options: dict, a: BuildArgs):
        cls = _wrapper_class(name)
        options = dict(options)
        inner = options.pop("press", WRAPPED)
        own = {key: options.pop(key) for key in _wrapper_fields(name) if key in options}
        if inner != WRAPPED:
            scorers = [n for n, e in REGISTRY.items() if e.factory.__qualname__.startswith("_kvpress.")]
            if inner not in scorers:
                raise ValueError(f"press={inner!r}: {WRAPPERS[name]} wraps {WRAPPED} (the default) or a kvpress scorer "
                                 f"press: one of {', '.join(scorers)}")
            if options:
                raise ValueError(f"{', '.join(sorted(options))}: settings of {WRAPPED}, which press={inner} does not "
                                 "take")
            return cls(REGISTRY[inner].factory({}, dataclasses.replace(a, base_ratio=a.ratio)), **own)
        if REGISTRY[name].default_scorer:  # threshold_budget: the learned scorer, whose text calibrates it
            options.setdefault("scorer", REGISTRY[name].default_scorer)
        return cls(_phase_aware(options, a), **own)
    return build


def _kvpress(class_name: str, seeded: bool = False):
    """kvpress's scorer press ``class_name`` at the baseline's ratio, with its defaults; ``seeded``: its Gaussian
    sketch drawn from a seed per layer (:func:`_seed_sketch`)."""
    def build(options: dict, a: BuildArgs):
        import kvpress

        press = getattr(kvpress, class_name)(a.base_ratio)
        return _seed_sketch(press) if seeded else press
    return build


def _seed_sketch(press):
    """``press`` (kvpress's ``LeverageScorePress``, or ``CompactorPress``, whose leverage scores are one), its
    random Gaussian sketch drawn from the seed ``layer_idx`` on every call, the RNG's state restored after: the same
    scores for the same prefill, so that an answer repeats across runs and resumes (kvpress's own evaluation seeds
    torch once per run; the replay compresses in no fixed order)."""
    import torch
    from kvpress import LeverageScorePress

    leverage = press if isinstance(press, LeverageScorePress) else press._leverage_press
    score = leverage.score

    def seeded(module, hidden_states, keys, values, attentions, kwargs):
        with torch.random.fork_rng(devices=[keys.device] if keys.device.type == "cuda" else []):
            torch.manual_seed(int(module.layer_idx))
            return score(module, hidden_states, keys, values, attentions, kwargs)

    leverage.score = seeded
    return press


def _kvzip(plus: bool):
    """kvpress's ``KVzipPress`` (KVzip+ with ``plus``) as the replay engine runs it: masks from scores of the whole
    context (:class:`~.replay.KVzipMasks`)."""
    def build(options: dict, a: BuildArgs):
        from .replay import KVzipMasks

        return KVzipMasks(a.base_ratio, kvzip_plus_normalization=plus)
    return build


def _kvgrad(options: dict, a: BuildArgs):
    """kvpress's ``KVgradPress`` as the replay engine runs it: masks from scores of the whole context
    (:class:`~.replay.KVgradMasks`)."""
    from .replay import KVgradMasks

    return KVgradMasks(a.base_ratio)


def _critical(class_name: str):
    """kvpress's ``class_name`` (``CriticalKVPress``, ``CriticalAdaKVPress``) around ``ExpectedAttentionPress`` with
    ``use_vnorm=False``, as kvpress's own evaluation pairs them (the value norm is CriticalKV's second stage)."""
    def build(options: dict, a: BuildArgs):
        import kvpress

        return getattr(kvpress, class_name)(press=kvpress.ExpectedAttentionPress(a.base_ratio, use_vnorm=False))
    return build


def _wrapping(class_name: str, default_scorer: str, **settings):
    """kvpress's wrapper ``class_name`` around kvpress's ``default_scorer`` press, or around the scorer of
    :data:`~kvpress_phase.presses.scorers.BASELINE_SCORERS` that ``scorer=NAME`` names, with kvpress's defaults
    otherwise (and ``settings``)."""
    def build(options: dict, a: BuildArgs):
        import kvpress

        from kvpress_phase.presses.scorers import BASELINE_SCORERS

        scorer = BASELINE_SCORERS[options["scorer"]] if "scorer" in options else getattr(kvpress, default_scorer)
        return getattr(kvpress, class_name)(press=scorer(a.base_ratio), **settings)
    return build


def _adakv(options: dict, a: BuildArgs):
    """kvpress's ``AdaKVPress`` around KeyDiff's scores, or around the scorer ``scorer=NAME`` names."""
    from kvpress import AdaKVPress

    from kvpress_phase.presses.scorers import BASELINE_SCORERS, scorer_from_name

    scorer = scorer_from_name(options.get("scorer", "keydiff"), BASELINE_SCORERS)
    scorer.compression_ratio = a.base_ratio
    return AdaKVPress(scorer)


def _kvzap(options: dict, a: BuildArgs):
    from kvpress_phase.presses.learned_scorer import LocalKVzapPress

    return LocalKVzapPress(compression_ratio=a.base_ratio)


def _dms_kvzap(options: dict, a: BuildArgs):
    """kvpress's ``DMSPress`` around ``KVzapPress`` with the shipped scorer, its threshold calibrated for the matched
    ratio (:class:`~kvpress_phase.presses.learned_scorer.CalibratedDMSPress`)."""
    from kvpress_phase.presses.calibrated_dms import CalibratedDMSPress
    from kvpress_phase.presses.learned_scorer import LocalKVzapPress

    return CalibratedDMSPress(LocalKVzapPress(), target_ratio=a.base_ratio)


def _chunk(class_name: str, default_scorer: str):
    """kvpress's chunk wrapper ``class_name`` around kvpress's ``default_scorer`` press, or around the scorer of
    :data:`~kvpress_phase.presses.scorers.BASELINE_SCORERS` that ``scorer=NAME`` names."""
    def build(options: dict, a: BuildArgs):
        import kvpress

        from kvpress_phase.presses.scorers import BASELINE_SCORERS

        scorer = BASELINE_SCORERS[options["scorer"]] if "scorer" in options else getattr(kvpress, default_scorer)
        return getattr(kvpress, class_name)(press=scorer(a.base_ratio), chunk_length=a.stride)
    return build


_WINDOW_ATTENTION = frozenset({HIDDEN_STATES, ATTENTIONS, QUESTION})

REGISTRY: dict[str, PressEntry] = {e.name: e for e in [
    PressEntry("no_press", "no compression (the uncompressed control)", lambda options, a: None),
    PressEntry("chunked_stride", "ChunkedStridePress: fixed windows every stride tokens, each keeps its k best tokens "
               "by KeyDiff score (:mode=pool merges them into k entries)", _chunked_stride,
               settings="fields", grid_offset=True, trainable=True, setting_names=_fields("ChunkedStridePress"),
               example="chunked_stride:mode=pool", overlapping_windows=lambda o: o.get("mode") == "pool"),
    PressEntry("phase_aware", "PhaseAwarePress: the same cache length, the row's best tokens by KeyDiff score "
               "wherever they are (no fixed budget per window)", _phase_aware,
               settings="fields", grid_offset=True, trainable=True, setting_names=_phase_aware_settings,
               example="phase_aware:scorer=kvzap"),
    PressEntry("head_budget", "HeadBudgetPress(PhaseAwarePress): its raw-token budget spread by score across the KV "
               "heads of each layer (each head its own tokens; floor=1.0: each head its own even budget; press=NAME wraps a "
               "kvpress scorer press instead, e.g. head_budget:press=knorm)",
               _budget("head_budget"), settings="fields", masks=True, grid_offset=True, trainable=True,
               in_default_job=False, setting_names=_wrapper_settings("head_budget"), wraps=WRAPPED,
               example="head_budget:scorer=kvzap"),
    PressEntry("layer_budget", "LayerBudgetPress(PhaseAwarePress): its raw-token budget spread by score across "
               "layers (each layer dense at its own length; press=NAME: a kvpress scorer press)", _budget("layer_budget"), settings="fields",
               grid_offset=True, trainable=True, in_default_job=False, setting_names=_wrapper_settings("layer_budget"),
               wraps=WRAPPED, example="layer_budget:scorer=kvzap"),
    PressEntry("global_budget", "GlobalBudgetPress(PhaseAwarePress): its raw-token budget spread by score across "
               "layers and KV heads together (KVzip's shape; press=NAME: a kvpress scorer press, e.g. "
               "global_budget:press=knorm)", _budget("global_budget"), settings="fields",
               masks=True, grid_offset=True, trainable=True, in_default_job=False, setting_names=_wrapper_settings("global_budget"),
               wraps=WRAPPED, example="global_budget:floor=0.25:scorer=kvzap"),
    PressEntry("threshold_budget", "retired (a study's ablation): ThresholdBudgetPress(PhaseAwarePress): its raw-token budget over layers and KV "
               "heads decided layer by layer, by a score threshold calibrated on the learned scorer's text (scorer "
               "kvzap by default)", _budget("threshold_budget"), settings="fields", masks=True, grid_offset=True,
               in_default_job=False, default_scorer="kvzap", setting_names=_wrapper_settings("threshold_budget"),
               wraps=WRAPPED, example="threshold_budget:floor=0.25"),
    PressEntry("staggered_window", "StaggeredWindowPress: a fixed budget per window on grids staggered per head, "
               "aligned to the scores or overlapping (the studies' ablations)",
               _staggered_window, settings="fields", grid_offset=True, in_default_job=False,
               setting_names=_fields("StaggeredWindowPress", window=True),
               example="staggered_window:budget=window_topk", overlapping_windows=lambda o: o.get("overlap") is True),
    PressEntry("snapkv", "kvpress SnapKVPress (attention of the last 64 prefill tokens' queries)",
               _kvpress("SnapKVPress"), reads=_WINDOW_ATTENTION, matched=True, chunk_scorer=True, shared_scores=True),
    PressEntry("knorm", "kvpress KnormPress (key norm)", _kvpress("KnormPress"), matched=True, chunk_scorer=True,
               shared_scores=True),
    # not shared_scores: StreamingLLM's scores mark the n_pruned tokens after the sink, so they depend on the ratio
    PressEntry("streaming_llm", "kvpress StreamingLLMPress (sink + recent tokens)", _kvpress("StreamingLLMPress"),
               matched=True),
    PressEntry("chunkkv", "kvpress ChunkKVPress(SnapKVPress) with chunks of stride tokens (:scorer=NAME wraps "
               "another scorer)", _chunk("ChunkKVPress", "SnapKVPress"), settings="scorer", matched=True,
               default_scorer="snapkv"),
    PressEntry("chunk", "kvpress ChunkPress(KnormPress) with chunks of stride tokens (:scorer=NAME wraps another "
               "scorer)", _chunk("ChunkPress", "KnormPress"), settings="scorer", matched=True, default_scorer="knorm"),
    PressEntry("expected_attention", "kvpress ExpectedAttentionPress (attention expected from future queries, "
               "extrapolated from the last hidden states)", _kvpress("ExpectedAttentionPress"),
               reads=_WINDOW_ATTENTION, matched=True, chunk_scorer=True, shared_scores=True),
    PressEntry("tova", "kvpress TOVAPress (attention of the last prefill token)", _kvpress("TOVAPress"),
               reads=_WINDOW_ATTENTION, matched=True, chunk_scorer=True, shared_scores=True),
    PressEntry("keydiff", "kvpress KeyDiffPress (keys least similar to the mean key)", _kvpress("KeyDiffPress"),
               matched=True, chunk_scorer=True, shared_scores=True),
    PressEntry("pyramidkv", "kvpress PyramidKVPress (SnapKV scores, budgets shrinking with depth)",
               _kvpress("PyramidKVPress"), reads=_WINDOW_ATTENTION, matched=True, shared_scores=True),
    PressEntry("kvzip", "kvpress KVzipPress (attention while the model repeats the context; global budget across "
               "layers and heads, evicted entries masked, not removed)", _kvzip(False), masks=True, matched=True),
    PressEntry("kvzip_plus", "kvpress KVzipPress(kvzip_plus_normalization=True) (KVzip+: the attention scaled by the "
               "value's output norm; global budget, masked)", _kvzip(True), masks=True, matched=True),
    PressEntry("adakv", "kvpress AdaKVPress(KeyDiffPress) (per-head budgets within each layer, masked; :scorer=NAME "
               "wraps another scorer, e.g. kvzap; kvpress's own evaluation calls AdaKVPress(ExpectedAttentionPress) "
               "'adakv': here adakv:scorer=expected_attention)", _adakv, settings="scorer", masks=True, matched=True,
               default_scorer="keydiff", scorers=("knorm", "keydiff", "snapkv", "tova", "expected_attention", "kvzap")),
    # kvpress 0.5.5's other presses that run offline on both real models (docs/evaluation.md lists those that do not,
    # and why), with kvpress's defaults; not in the default job
    PressEntry("cur", "kvpress CURPress (CurDKV: approximate leverage of each key times its value's, normalised in "
               "windows of 16 tokens; the first 4 kept)", _kvpress("CURPress"), matched=True, in_default_job=False,
               shared_scores=True),
    PressEntry("lagkv", "kvpress LagKVPress (spread of each key and value scaled by the next partition's range, "
               "partitions of 128 tokens; the first 4 tokens and the last partition kept)", _kvpress("LagKVPress"),
               matched=True, in_default_job=False, shared_scores=True),
    PressEntry("leverage", "kvpress LeverageScorePress (approximate statistical leverage of the pre-RoPE keys: "
               "outliers kept; its Gaussian sketch drawn from a seed per layer)", _kvpress("LeverageScorePress", True),
               reads=frozenset({HIDDEN_STATES}), matched=True, in_default_job=False),
    PressEntry("non_causal_attn", "kvpress NonCausalAttnPress (attention each key gets from every query of its chunk "
               "of 256 tokens, non-causal, times its value's norm)", _kvpress("NonCausalAttnPress"),
               reads=frozenset({HIDDEN_STATES, QUESTION}), matched=True, in_default_job=False, shared_scores=True),
    PressEntry("compactor", "kvpress CompactorPress (leverage scores blended with non-causal chunked attention, "
               "weighted by the ratio; the first 8 and last 4 tokens kept; its sketch drawn from a seed per layer)",
               _kvpress("CompactorPress", True), reads=frozenset({HIDDEN_STATES, QUESTION}), matched=True,
               in_default_job=False),
    PressEntry("cap", "kvpress CapPress (CAPKV: capacity of each value, weighted by its key's alignment with the "
               "mean query; the first 4 kept)", _kvpress("CapPress"), reads=frozenset({HIDDEN_STATES, QUESTION}),
               matched=True, in_default_job=False, shared_scores=True),
    PressEntry("entropy_chunkkv", "kvpress EntropyGatedChunkKVPress(SnapKVPress) (ChunkKV with chunks of 10 tokens, "
               "a high-scoring chunk of low score entropy cut to its 4 best; :scorer=NAME wraps another scorer)",
               _wrapping("EntropyGatedChunkKVPress", "SnapKVPress"), settings="scorer", matched=True,
               in_default_job=False, default_scorer="snapkv"),
    PressEntry("block", "kvpress BlockPress(KeyDiffPress) (KeyDiff's scores over blocks of 128 tokens, compressed "
               "block after block; kvpress's evaluation's block_keydiff)",
               _wrapping("BlockPress", "KeyDiffPress", block_size=128), reads=frozenset({HIDDEN_STATES}),
               matched=True, in_default_job=False),
    PressEntry("merging", "kvpress MergingPress(KnormPress) (each evicted entry's value merged into its most similar "
               "kept entry's; :scorer=NAME wraps another scorer)", _wrapping("MergingPress", "KnormPress"),
               settings="scorer", matched=True, in_default_job=False, default_scorer="knorm",
               scorers=("knorm", "keydiff", "snapkv", "tova", "expected_attention", "kvzap")),
    PressEntry("critical_kv", "kvpress CriticalKVPress(ExpectedAttentionPress) (expected attention, rescaled in a "
               "second stage by the output projection of each value; as kvpress's evaluation pairs them)",
               _critical("CriticalKVPress"), reads=_WINDOW_ATTENTION, matched=True, in_default_job=False),
    PressEntry("critical_adakv", "kvpress CriticalAdaKVPress(ExpectedAttentionPress) (CriticalKV's scores with "
               "AdaKV's per-head budgets within each layer, masked)", _critical("CriticalAdaKVPress"),
               reads=_WINDOW_ATTENTION, masks=True, matched=True, in_default_job=False),
    PressEntry("kvgrad", "kvpress KVgradPress (KVzip's reconstruction of the context, each entry scored by its "
               "attention, its value's output norm and the gradient of the last hidden states; global budget, "
               "masked)", _kvgrad, masks=True, matched=True, in_default_job=False),
    PressEntry("kvzap", "kvpress KVzapPress with the scorer shipped for the model (learned KVzip+ scores from the "
               "layer's input, the same count per head; a linear scorer, trained here: kvpress's own evaluation names "
               "its hub MLP kvzap_mlp_head)", _kvzap, reads=frozenset({HIDDEN_STATES}), matched=True,
               in_default_job=False, shared_scores=True),
    PressEntry("dms_kvzap", "kvpress DMSPress(KVzapPress) with the scorer shipped for the model, as kvpress pairs them "
               "(entries scored below a threshold masked, the last 128 tokens kept); the threshold from the scorer's "
               "calibration for the ratio, so what each context keeps follows its scores", _dms_kvzap,
               reads=frozenset({HIDDEN_STATES}), masks=True, matched=True, in_default_job=False),
]}
"""Every press the evaluation can run, by name (the CLI's ``list`` prints them in this order)."""

CHUNK_SCORERS = tuple(name for name, entry in REGISTRY.items() if entry.chunk_scorer)
"""Scorers a chunk wrapper accepts by name (the entries marked ``chunk_scorer``)."""

TRAINABLE_PRESSES = tuple(name for name, entry in REGISTRY.items() if entry.trainable)
"""Presses a model can be fine-tuned with (the entries marked ``trainable``)."""

RECOMMENDED_WITH_SCORER = "global_budget:scorer=kvzap"
"""The press the README recommends for a model that ships a KVzap scorer, as a spec: the ratio-regimes round's
frozen choice (docs/preregistration-ratio-regimes.md), read on its fresh split in docs/results/regimes/. ``eval``
runs it by default on such a model (:func:`kvpress_phase.evaluation.flags.default_presses`)."""


def matched_ratio(context_length: int, stride: int, compression_ratio: float) -> float:
    """The compression ratio at which a kvpress scorer press keeps exactly as many entries as
    ``ChunkedStridePress(compression_ratio, stride=stride)`` (default ``n_sink`` and ``n_local``) does for
    ``context_length`` tokens. kvpress keeps ``int(n * (1 - ratio))`` entries; the half entry keeps ``int`` exact
    against rounding. The chunk wrappers round per chunk of ``stride`` tokens at this ratio, so they keep fewer and
    no ratio need match: ``ChunkPress`` keeps ``int(stride * (1 - ratio))`` entries of every chunk (up to one entry
    per chunk fewer: 768 against 779 at 1,024 tokens, stride 20, ratio 0.25, where its counts jump from 768 to 819),
    ``ChunkKVPress`` whole chunks; the runner records the entries each answer had (``cache_length``)."""
    from kvpress_phase import ChunkedStridePress
    from kvpress_phase.core.phase import compressed_length

    ref = ChunkedStridePress(compression_ratio, stride=stride)
    kept = compressed_length(context_length, stride, compression_ratio, ref.n_sink, ref.n_local)
    return min(max((context_length - kept - 0.5) / context_length, 0.0), 0.999999)


def build_press(spec: PressSpec, compression_ratio: float, stride: int, window: Optional[int], offset: int,
                *, matched_context_length: Optional[int] = None):
    """The press ``spec`` at ``compression_ratio`` (None for ``no_press``).

    With ``matched_context_length``, the presses whose entry is ``matched`` (kvpress's) run at
    :func:`matched_ratio` for that many tokens instead of the nominal ratio, so that they keep as many entries as
    ``ChunkedStridePress`` does.
    """
    entry = spec.entry
    base_ratio = compression_ratio
    if matched_context_length is not None and entry.matched and compression_ratio > 0:
        base_ratio = matched_ratio(matched_context_length, stride, compression_ratio)
    args = BuildArgs(compression_ratio, base_ratio, stride, window if entry.grid_offset else None,
                     offset if entry.grid_offset else 0)
    try:
        return entry.factory(dict(spec.options), args)
    except TypeError as exc:  # an unknown keyword in the settings
        raise ValueError(f"invalid setting for press {spec.label!r}: {exc}") from None
