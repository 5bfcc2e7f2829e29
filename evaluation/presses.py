"""Presses by name: one registry entry per press, ours and kvpress's baselines.

A press spec is a registered name, optionally followed by ``:key=value`` settings: any field of our presses but
those the run sets (``chunked_stride:mode=pool``, ``phase_aware:residual=pool``; :func:`press_settings`), or
``scorer=NAME`` for kvpress's chunk wrappers (``chunk:scorer=keydiff``). Values are parsed as ints, floats,
``true``/``false`` or strings; an unknown key is refused with the press's settings.

Everything the evaluation knows about a press is its :class:`PressEntry` in :data:`REGISTRY`: its description (the
CLI's ``list``), its factory, what its scores read (the prefill records only that; the question, when it is
compressed with the context), whether it masks entries instead of removing them, whether the offset protocol moves
its grid, and whether ``--matched-cache`` runs it at the ratio that matches ``ChunkedStridePress``'s cache length.
The runner, the CLI, the reports and the training configuration read these entries, never a class name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

HIDDEN_STATES, ATTENTIONS, QUESTION = "hidden_states", "attentions", "question"


LEGACY_ROW_OPTIONS = ("align", "stagger", "spread", "overlap", "mode")
"""Settings that ``phase_aware`` specs written before the presses were reshaped carried and that did nothing under
``PhaseAwarePress``'s row budget (the grid and window settings of its per-window budgets, now
:class:`~kvpress_phase.StaggeredWindowPress`): refused, naming the spelling of today (:func:`current_spelling`)."""


def current_spelling(text: str) -> str:
    """Today's spelling of a press spec written before the presses were reshaped, or ``text`` itself when it is
    current: ``phase_aware:budget=window`` (or ``window_topk``) is ``staggered_window`` (``budget=window_topk``
    kept, every other setting too); ``budget=row`` and :data:`LEGACY_ROW_OPTIONS` on ``phase_aware`` did nothing and
    are dropped. Results written under a former spelling keep it as their label."""
    name, *items = text.strip().split(":")
    if name != "phase_aware":
        return text.strip()
    budget = next((item.partition("=")[2] for item in items if item.startswith("budget=")), None)
    if budget in ("window", "window_topk"):
        kept = [item for item in items if item != "budget=window"]
        return ":".join(["staggered_window", *kept])
    kept = [item for item in items
            if item != "budget=row" and item.partition("=")[0] not in LEGACY_ROW_OPTIONS]
    return ":".join(["phase_aware", *kept])


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
    example: Optional[str] = None
    """A spec with settings that ``kvpress-phase list`` shows (None: the name, or ``scorer=`` its first other
    scorer; :func:`example_spec`)."""


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

        run = set(RUN_SETTINGS) - ({"window"} if window else set())
        own = [f.name for f in dataclasses.fields(getattr(kvpress_phase, class_name))
               if f.init and not f.name.startswith("_") and f.name not in run]
        return tuple(dict.fromkeys(own + list(extra)))
    return names


BUDGETS = {"even": None, "heads": "HeadBudgetPress", "layers": "LayerBudgetPress",
           "layers_heads": "GlobalBudgetPress"}
"""``phase_aware:allocate=NAME``: the budget wrapper (:mod:`kvpress_phase.presses.budget`) around ``PhaseAwarePress``
(``even``: none). ``floor`` is the wrapper's; ``share_heads=false`` alone is ``HeadBudgetPress(floor=1.0)`` (each
KV head its own even budget), and ``allocate=heads`` or ``layers_heads`` needs it, as the spelling of the runs that
are committed has it."""


PHASE_AWARE_BUDGET = {"allocate": "even", "floor": None, "share_heads": True}
"""``phase_aware``'s budget settings and their defaults (``floor``: unset, 0.0 in a wrapper)."""


def _phase_aware_settings(options: dict) -> tuple:
    """``phase_aware``'s settings: ``PhaseAwarePress``'s fields, with ``allocate``, ``floor`` and ``share_heads``
    (a budget wrapper, :data:`BUDGETS`) and ``window`` (equal to the stride: the press has no windows)."""
    return _fields("PhaseAwarePress", "allocate", "floor", "share_heads", "window")(options)


def _budget_wrapper(press, allocate: str, floor, share_heads):
    """``press`` inside the budget wrapper that ``allocate``, ``floor`` and ``share_heads`` name (:data:`BUDGETS`)."""
    import kvpress_phase

    if allocate not in BUDGETS:
        raise ValueError(f"allocate must be one of {tuple(BUDGETS)}, got {allocate!r}")
    if not isinstance(share_heads, bool):
        raise ValueError(f"share_heads must be true or false, got {share_heads!r}")
    per_head = allocate in ("heads", "layers_heads")
    if per_head and share_heads:
        raise ValueError(f"allocate={allocate} gives each KV head its own tokens: add share_heads=false")
    if allocate == "layers" and not share_heads:
        raise ValueError("allocate=layers keeps one choice per layer, shared by its KV heads; per KV head across "
                         "layers is allocate=layers_heads:share_heads=false")
    if allocate == "even":
        if floor is not None:
            raise ValueError("floor is a setting of a budget spread by score: it needs allocate=heads, layers or "
                             "layers_heads")
        return press if share_heads else kvpress_phase.HeadBudgetPress(press, floor=1.0)
    return getattr(kvpress_phase, BUDGETS[allocate])(press, floor=0.0 if floor is None else floor)


def _chunked_stride(options: dict, a: BuildArgs):
    from kvpress_phase import ChunkedStridePress

    return ChunkedStridePress(a.ratio, stride=a.stride, window=a.window or a.stride, offset=a.offset, **options)


def _staggered_window(options: dict, a: BuildArgs):
    from kvpress_phase import StaggeredWindowPress

    window = {"window": a.window} if a.window else {}
    return StaggeredWindowPress(a.ratio, stride=a.stride, offset=a.offset, **window, **options)


def _phase_aware(options: dict, a: BuildArgs):
    """``PhaseAwarePress``, inside the budget wrapper that ``allocate``, ``floor`` and ``share_heads`` name."""
    from kvpress_phase import PhaseAwarePress

    options = dict(options)
    window = options.pop("window", None) or a.window
    if window and window != a.stride:
        raise ValueError(f"window ({window}) must equal stride ({a.stride}) for PhaseAwarePress, whose choice has no "
                         "windows; overlapping windows are StaggeredWindowPress's (staggered_window)")
    budget = [options.pop(k, default) for k, default in PHASE_AWARE_BUDGET.items()]
    return _budget_wrapper(PhaseAwarePress(a.ratio, stride=a.stride, offset=a.offset, **options), *budget)


def _kvpress(class_name: str):
    def build(options: dict, a: BuildArgs):
        import kvpress

        return getattr(kvpress, class_name)(a.base_ratio)
    return build


def _kvzip(plus: bool):
    """kvpress's ``KVzipPress`` (KVzip+ with ``plus``) as the replay engine runs it: masks from scores of the whole
    context (:class:`~.replay.KVzipMasks`)."""
    def build(options: dict, a: BuildArgs):
        from .replay import KVzipMasks

        return KVzipMasks(a.base_ratio, kvzip_plus_normalization=plus)
    return build


def _adakv(options: dict, a: BuildArgs):
    """kvpress's ``AdaKVPress`` around KeyDiff's scores, or around the scorer ``scorer=NAME`` names."""
    from kvpress import AdaKVPress

    from kvpress_phase.presses.scorers import scorer_from_name

    scorer = scorer_from_name(options.get("scorer", "keydiff"))
    scorer.compression_ratio = a.base_ratio
    return AdaKVPress(scorer)


def _kvzap(options: dict, a: BuildArgs):
    from kvpress_phase.presses.learned_scorer import LocalKVzapPress

    return LocalKVzapPress(compression_ratio=a.base_ratio)


def _chunk(class_name: str, default_scorer: str):
    """kvpress's chunk wrapper ``class_name`` around kvpress's ``default_scorer`` press, or around the scorer of
    :data:`~kvpress_phase.presses.scorers.SCORERS` that ``scorer=NAME`` names."""
    def build(options: dict, a: BuildArgs):
        import kvpress

        from kvpress_phase.presses.scorers import SCORERS

        scorer = SCORERS[options["scorer"]] if "scorer" in options else getattr(kvpress, default_scorer)
        return getattr(kvpress, class_name)(press=scorer(a.base_ratio), chunk_length=a.stride)
    return build


_WINDOW_ATTENTION = frozenset({HIDDEN_STATES, ATTENTIONS, QUESTION})

REGISTRY: dict[str, PressEntry] = {e.name: e for e in [
    PressEntry("no_press", "no compression (the uncompressed control)", lambda options, a: None),
    PressEntry("chunked_stride", "ChunkedStridePress: fixed windows every stride tokens, each keeps its k best tokens "
               "by KeyDiff score (:mode=pool merges them into k entries)", _chunked_stride,
               settings="fields", grid_offset=True, trainable=True, setting_names=_fields("ChunkedStridePress"),
               example="chunked_stride:mode=pool"),
    PressEntry("phase_aware", "PhaseAwarePress: the same cache length, the row's best tokens by KeyDiff score "
               "wherever they are (no fixed budget per window)", _phase_aware,
               settings="fields", grid_offset=True, trainable=True, setting_names=_phase_aware_settings,
               example="phase_aware:scorer=kvzap:allocate=layers"),
    PressEntry("staggered_window", "StaggeredWindowPress: a fixed budget per window on grids staggered per head, "
               "aligned to the scores or overlapping (the studies' ablations)",
               _staggered_window, settings="fields", grid_offset=True, in_default_job=False,
               setting_names=_fields("StaggeredWindowPress", window=True),
               example="staggered_window:budget=window_topk"),
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
               "wraps another scorer, e.g. kvzap)", _adakv, settings="scorer", masks=True, matched=True,
               default_scorer="keydiff", scorers=("knorm", "keydiff", "snapkv", "tova", "expected_attention", "kvzap")),
    PressEntry("kvzap", "kvpress KVzapPress with the scorer shipped for the model (learned KVzip+ scores from the "
               "layer's input, the same count per head)", _kvzap, reads=frozenset({HIDDEN_STATES}), matched=True,
               in_default_job=False, shared_scores=True),
]}
"""Every press the evaluation can run, by name (the CLI's ``list`` prints them in this order)."""

CHUNK_SCORERS = tuple(name for name, entry in REGISTRY.items() if entry.chunk_scorer)
"""Scorers a chunk wrapper accepts by name (the entries marked ``chunk_scorer``)."""

TRAINABLE_PRESSES = tuple(name for name, entry in REGISTRY.items() if entry.trainable)
"""Presses a model can be fine-tuned with (the entries marked ``trainable``)."""


def scorer_reads_question(name: str) -> bool:
    """Whether the scorer ``name`` (a registry name) reads the last prefill tokens, hence the question under
    ``--query-aware``: its entry reads :data:`QUESTION`."""
    return name in REGISTRY and QUESTION in REGISTRY[name].reads


@dataclass(frozen=True)
class PressSpec:
    name: str
    options: tuple = ()

    @property
    def label(self) -> str:
        return self.name + "".join(f":{k}={v}" for k, v in self.options)

    @property
    def entry(self) -> PressEntry:
        return REGISTRY[self.name]


def entry_of(spec) -> PressEntry:
    """The registry entry of a :class:`PressSpec` or of a spec's text."""
    return REGISTRY[(spec if isinstance(spec, str) else spec.name).split(":")[0]]


def reads_question(spec: PressSpec) -> bool:
    """Whether the press ``spec`` sees the question when it is compressed with the context: a press whose entry
    reads it, a chunk wrapper around such a scorer, and ours when their scores do (a question-aware ``scorer=``
    such as SnapKV's, for ``PhaseAwarePress`` or for selection and score weighting in ``ChunkedStridePress``; the
    defaults' KeyDiff scores do not read it)."""
    entry = spec.entry
    options = dict(spec.options)
    if entry.settings == "scorer":
        return scorer_reads_question(options.get("scorer", entry.default_scorer))
    if entry.settings == "fields":
        return scorer_reads_question(options.get("scorer", "")) and build_press(spec, 0.5, 8, None, 0).needs_scores
    return QUESTION in entry.reads


def query_aware_warning(presses) -> Optional[str]:
    """What ``--query-aware`` does not change for the press specs ``presses`` (texts or :class:`PressSpec`): the
    compressing presses whose scores never read the question (:func:`reads_question`), or that none of them does;
    None when every one reads it (or nothing is compressed)."""
    specs = [parse_press_spec(p) if isinstance(p, str) else p for p in presses]
    blind = [s.label for s in specs if s.name != "no_press" and not reads_question(s)]
    if not blind:
        return None
    compressing = [s for s in specs if s.name != "no_press"]
    if len(blind) == len(compressing):
        what, whose = "none of the presses reads", "no press's choice of entries depends on it"
    elif len(blind) == 1:
        what, whose = f"{blind[0]} does not read", "its choice of entries ignores it"
    else:
        what, whose = f"{', '.join(blind)} do not read", "their choice of entries ignores it"
    return (f"--query-aware: {what} the question (Q in `kvpress-phase list`): the question is compressed with the "
            f"context, but {whose}")


def prefill_reads(spec: PressSpec) -> frozenset:
    """The optional compress inputs the press ``spec`` reads (:data:`HIDDEN_STATES`, :data:`ATTENTIONS`), which the
    replayed prefill must record: its entry's, or for a press that takes a scorer (ours, kvpress's chunk wrappers),
    its scorer's entry's (a scorer without one, such as random scores, is assumed to read both). kvpress's chunk
    wrappers also need the attention weights as recorded: they refuse any they are handed."""
    entry = spec.entry
    if entry.settings == "none":
        return entry.reads - {QUESTION}
    scorer = dict(spec.options).get("scorer", entry.default_scorer or "keydiff")
    reads = REGISTRY[scorer].reads if scorer in REGISTRY else frozenset({HIDDEN_STATES, ATTENTIONS})
    if entry.settings == "scorer":
        reads = reads | {ATTENTIONS}
    return reads - {QUESTION}


def shares_scores(spec: PressSpec) -> bool:
    """Whether the replay engine may compute the scores of a whole layer once per prefill for the press ``spec``
    and reuse them at every ratio, stride and grid offset: a kvpress press whose entry is marked ``shared_scores``,
    or ours around such a scorer (``scorer=NAME``; KeyDiff by default). Never kvpress's chunk wrappers (they score
    parts of a layer), nor a scorer without an entry (random scores)."""
    entry = spec.entry
    if entry.settings == "none":
        return entry.shared_scores
    if entry.settings == "scorer":
        return False
    scorer = dict(spec.options).get("scorer", "keydiff")
    return scorer in REGISTRY and REGISTRY[scorer].shared_scores


def press_settings(name: str, options: Optional[dict] = None) -> tuple:
    """The keys a spec of the press ``name`` may set, given its other ``options``: ``scorer`` for kvpress's chunk
    wrappers, none for kvpress's other presses, and for ours their fields but those the run sets
    (:data:`RUN_SETTINGS`)."""
    entry = REGISTRY[name]
    if entry.settings == "scorer":
        return ("scorer",)
    if entry.settings == "none" or entry.setting_names is None:
        return ()
    return entry.setting_names(dict(options or {}))


def setting_defaults(name: str) -> dict:
    """``{setting: default}`` for the keys a spec of the press ``name`` may set (:func:`press_settings`): for ours
    the default of the press class's field (a scorer by its name in ``SCORERS``), or of the factory's own setting
    (:data:`PHASE_AWARE_BUDGET`; ``window``: None, the stride); for kvpress's wrappers the scorer they wrap."""
    import dataclasses

    entry = REGISTRY[name]
    if entry.settings == "scorer":
        return {"scorer": entry.default_scorer}
    keys = press_settings(name)
    if not keys:
        return {}
    from kvpress_phase.presses.scorers import SCORERS

    fields = {f.name: f for f in dataclasses.fields(type(build_press(PressSpec(name), 0.5, 8, None, 0)))}
    scorer_names = {cls: scorer for scorer, cls in SCORERS.items()}
    defaults = {}
    for key in keys:
        f = fields.get(key)
        if f is None:
            defaults[key] = PHASE_AWARE_BUDGET.get(key)
        elif f.default is not dataclasses.MISSING:
            defaults[key] = f.default
        else:
            made = f.default_factory()
            defaults[key] = scorer_names.get(type(made), type(made).__name__)
    return defaults


def example_spec(name: str) -> str:
    """A spec of the press ``name`` for ``kvpress-phase list``: its entry's :attr:`~PressEntry.example`, else for
    kvpress's wrappers ``scorer=`` their first other scorer, else the name."""
    entry = REGISTRY[name]
    if entry.example:
        return entry.example
    if entry.settings == "scorer":
        other = next(s for s in entry.scorers or CHUNK_SCORERS if s != entry.default_scorer)
        return f"{name}:scorer={other}"
    return name


def _check_setting_names(name: str, options: list, text: str) -> None:
    """ValueError naming a key of ``options`` that the press ``name`` does not take, with its settings."""
    import difflib

    valid = press_settings(name, dict(options))
    listed = f"{name}'s settings: {', '.join(valid)}"
    for key, _ in options:
        if key in valid:
            continue
        if key in RUN_SETTINGS:
            raise ValueError(f"press setting {key!r} in {text!r} is set by {RUN_SETTINGS[key]}, not in the press "
                             f"spec; {listed}")
        close = difflib.get_close_matches(key, list(valid) + [k for k in RUN_SETTINGS if k not in valid], n=1)
        hint = ""
        if close and close[0] in valid:
            hint = f" (did you mean {close[0]}?)"
        elif close:
            hint = f" (did you mean {close[0]}? it is set by {RUN_SETTINGS[close[0]]})"
        raise ValueError(f"press {name!r} has no setting {key!r}{hint}; {listed}")


def _parse_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_press_spec(text: str) -> PressSpec:
    """``name[:key=value...]`` to a :class:`PressSpec`; ValueError naming the problem otherwise."""
    name, *settings = text.strip().split(":")
    if name not in REGISTRY:
        raise ValueError(f"unknown press {name!r}; valid presses: {', '.join(REGISTRY)}")
    entry = REGISTRY[name]
    today = current_spelling(text)
    if today != text.strip():
        raise ValueError(
            f"press spec {text.strip()!r} is a former spelling: write {today!r} (PhaseAwarePress's "
            "per-window budgets are StaggeredWindowPress, staggered_window; budget=row and "
            f"{', '.join(LEGACY_ROW_OPTIONS)} did nothing under PhaseAwarePress)")
    options = []
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"press setting {item!r} in {text!r} must look like key=value")
        if entry.settings == "scorer":
            scorers = entry.scorers or CHUNK_SCORERS
            if key != "scorer" or value not in scorers:
                raise ValueError(f"press {name!r} takes only scorer=NAME with NAME one of {', '.join(scorers)} "
                                 f"(got {item!r})")
        elif entry.settings == "none":
            raise ValueError(f"press {name!r} takes no settings (got {item!r})")
        if key == "decoding":
            raise ValueError(
                f"press setting {item!r}: the phase evaluation replays the prefill's compression and decodes its "
                "short answers without press hooks, so decoding compression would not apply"
            )
        options.append((key, _parse_value(value)))
    if entry.settings == "fields":
        _check_setting_names(name, options, text)
    spec = PressSpec(name, tuple(options))
    build_press(spec, 0.5, 8, None, 0)  # validate the settings now, not mid-run
    return spec


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
