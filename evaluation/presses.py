"""Press specs: a registered name, optionally followed by ``:key=value`` settings, parsed into a :class:`PressSpec`.

A spec sets any field of our presses but those the run sets (``chunked_stride:mode=pool``,
``phase_aware:residual=pool``; :func:`press_settings`), a budget wrapper's ``floor`` and the settings of the
``PhaseAwarePress`` it wraps (``layer_budget:scorer=kvzap``), or ``scorer=NAME`` for kvpress's chunk wrappers
(``chunk:scorer=keydiff``). Values are parsed as ints, floats, ``true``/``false`` or strings; an unknown key is
refused with the press's settings. A spec's label is canonical (settings sorted, booleans lowercase), and a former
spelling is read through the alias table of :mod:`.spellings` (``phase_aware:allocate=layers`` is
``layer_budget``).

What the evaluation knows about each press is its entry in the registry (:mod:`.press_registry`, re-exported
here with :func:`build_press`); this module answers what a spec needs: its settings and their defaults, what its
scores read, whether the replay engine may share them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .press_registry import (ATTENTIONS, CHUNK_SCORERS, HIDDEN_STATES, QUESTION, RECOMMENDED_WITH_SCORER,  # noqa: F401
                             REGISTRY, RUN_SETTINGS, TRAINABLE_PRESSES, BuildArgs, PressEntry, build_press,
                             matched_ratio)
from .spellings import LEGACY_ROW_OPTIONS, canonical_label, current_spelling, respelled  # noqa: F401


def scorer_reads_question(name: str) -> bool:
    """Whether the scorer ``name`` (a registry name) reads the last prefill tokens, hence the question under
    ``--query-aware``: its entry reads :data:`QUESTION`."""
    return name in REGISTRY and QUESTION in REGISTRY[name].reads


@dataclass(frozen=True)
class PressSpec:
    """A registered press and its settings, ``((key, value), ...)`` (:func:`parse_press_spec`)."""

    name: str
    options: tuple = ()

    @property
    def label(self) -> str:
        """The press's name in results (the ``press`` column): canonical, settings sorted and booleans lowercase
        (:func:`~.spellings.canonical_label`), whatever order the spec was written in."""
        return canonical_label(self.name + "".join(f":{k}={str(v).lower() if isinstance(v, bool) else v}"
                                                   for k, v in self.options))

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
    options = dict(spec.options)
    scorer = options.get("press") if options.get("press") in REGISTRY else \
        options.get("scorer", entry.default_scorer or "keydiff")  # a wrapper around a kvpress press reads its inputs
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
    options = dict(spec.options)
    scorer = options.get("press") if options.get("press") in REGISTRY else \
        options.get("scorer", entry.default_scorer or "keydiff")
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
    the default of the press class's field (a scorer by its name in ``SCORERS``; ``window``: None, the stride), for
    a budget wrapper its own settings (``floor``, and ``press``: the press it wraps, whose settings are listed under
    its own name), for kvpress's wrappers the scorer they wrap."""
    import dataclasses

    entry = REGISTRY[name]
    if entry.settings == "scorer":
        return {"scorer": entry.default_scorer}
    keys = press_settings(name)
    if entry.wraps:
        inner = set(press_settings(entry.wraps))
        keys = tuple(key for key in keys if key not in inner)
    if not keys:
        return {}
    from kvpress_phase.presses.scorers import SCORERS

    fields = {f.name: f for f in dataclasses.fields(type(build_press(PressSpec(name), 0.5, 8, None, 0)))}
    scorer_names = {cls: scorer for scorer, cls in SCORERS.items()}
    defaults = {}
    for key in keys:
        f = fields.get(key)
        if key == "press" and entry.wraps:
            defaults[key] = entry.wraps
        elif f is None:
            defaults[key] = None
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
    """``name[:key=value...]`` to a :class:`PressSpec`, its settings sorted; ValueError naming the problem otherwise.

    A former spelling of the budget wrappers (``phase_aware:allocate=layers``, ``phase_aware:share_heads=false``) is
    read through the alias table (:func:`~.spellings.respelled`): the spec runs under today's name and label
    (``layer_budget``, ``head_budget:floor=1.0``). Specs of the older reshaping are refused with today's spelling
    named (:func:`~.spellings.current_spelling`)."""
    text = text.strip()
    name = text.split(":")[0]
    if name not in REGISTRY:
        raise ValueError(f"unknown press {name!r}; valid presses: {', '.join(REGISTRY)}")
    today = current_spelling(text)
    if today != text:
        raise ValueError(
            f"press spec {text!r} is a former spelling: write {today!r} (PhaseAwarePress's "
            "per-window budgets are StaggeredWindowPress, staggered_window; budget=row and "
            f"{', '.join(LEGACY_ROW_OPTIONS)} did nothing under PhaseAwarePress)")
    name, *settings = respelled(text).split(":")
    entry = REGISTRY[name]
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
