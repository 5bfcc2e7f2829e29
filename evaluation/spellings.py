"""Press specs as they are spelled today, and the one alias table that reads the former spellings.

A press's label (:attr:`.presses.PressSpec.label`, the ``press`` column of every answer) is canonical: the registry
name, then its settings sorted by key, booleans written ``true``/``false`` (:func:`canonical_label`). The budget
wrappers are named like their classes, ``head_budget`` (:class:`~kvpress_phase.HeadBudgetPress`), ``layer_budget``
and ``global_budget``, and take ``floor=`` and the settings of the ``PhaseAwarePress`` they wrap
(``global_budget:floor=0.25:scorer=kvzap`` is ``GlobalBudgetPress(PhaseAwarePress(scorer="kvzap"), floor=0.25)``).

Before they had names, the wrappers were settings of ``phase_aware`` (``allocate``, ``share_heads``, ``floor``), and
labels kept the order and case they were typed in. :data:`BUDGET_ALIASES` maps those spellings to today's; it is
applied wherever a spec or a label is read: :func:`.presses.parse_press_spec` (a former spelling on the command line
still runs, under today's label), and :func:`canonical_label`/:func:`canonical_key`, which
:func:`.store.read_results` and the runner's resume apply to the answers as they are loaded, so a run written under
a former spelling reads exactly as if it had been written today.

Specs of the older reshaping of the presses (``phase_aware:budget=window`` and the row options that did nothing,
:func:`current_spelling`) are refused on the command line with today's spelling named, and results written under
them keep their label's settings (sorted, booleans lowercase): a bare ``phase_aware`` of those runs was another
configuration, so no alias can name them.
"""

from __future__ import annotations

BUDGET_ALIASES = {
    ("even", True): ("phase_aware", ()),
    ("even", False): ("head_budget", (("floor", "1.0"),)),
    ("heads", False): ("head_budget", ()),
    ("layers", True): ("layer_budget", ()),
    ("layers_heads", False): ("global_budget", ()),
}
"""The alias table: ``phase_aware``'s former ``(allocate, share_heads)`` settings to today's press name and the
settings that name adds. ``share_heads=false`` alone (each KV head its own even budget) is
``head_budget:floor=1.0``; ``floor=F`` is kept as the wrapper's ``floor``; ``share_heads`` left out is the one its
``allocate`` needs (``allocate=heads`` alone is ``head_budget``)."""

FORMER_BUDGET_SETTINGS = ("allocate", "share_heads", "floor")
"""The settings of ``phase_aware`` that :data:`BUDGET_ALIASES` reads."""

WRAPPERS = {"head_budget": "HeadBudgetPress", "layer_budget": "LayerBudgetPress", "global_budget": "GlobalBudgetPress",
            "threshold_budget": "ThresholdBudgetPress"}
"""The budget wrappers' registry names and classes (:mod:`kvpress_phase.presses.budget`)."""

WRAPPED = "phase_aware"
"""The press a wrapper spec wraps (``press=phase_aware``, the default and the only press the wrappers take; a label
leaves it out)."""

LEGACY_ROW_OPTIONS = ("align", "stagger", "spread", "overlap", "mode")
"""Settings that ``phase_aware`` specs written before the presses were reshaped carried and that did nothing under
``PhaseAwarePress``'s row budget (the grid and window settings of its per-window budgets, now
:class:`~kvpress_phase.StaggeredWindowPress`): refused, naming the spelling of today (:func:`current_spelling`)."""


def current_spelling(text: str) -> str:
    """Today's spelling of a press spec written before the presses were reshaped, or ``text`` itself when it is
    current: ``phase_aware:budget=window`` (or ``window_topk``) is ``staggered_window`` (``budget=window_topk``
    kept, every other setting too); ``budget=row`` and :data:`LEGACY_ROW_OPTIONS` on ``phase_aware`` did nothing and
    are dropped. Results written under such a spelling keep its settings in their label."""
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


def _split(text: str) -> tuple[str, list[tuple[str, str]]]:
    """``name`` and the ``(key, value)`` settings of a spec's text, as written; ValueError for a setting that is not
    ``key=value``."""
    name, *items = text.strip().split(":")
    settings = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"press setting {item!r} in {text.strip()!r} must look like key=value")
        settings.append((key, value))
    return name, settings


def _boolean(text: str):
    """True or False for ``true``/``false`` in any case (as :func:`.presses.parse_value` reads them), else None."""
    low = text.lower()
    return (low == "true") if low in ("true", "false") else None


def _respelled_budget(text: str, settings: list) -> tuple[str, list]:
    """``phase_aware``'s former budget settings in ``settings`` as today's press and settings
    (:data:`BUDGET_ALIASES`); ValueError naming the spec for a combination that never named a press."""
    former = {key: value for key, value in settings if key in FORMER_BUDGET_SETTINGS}
    rest = [(key, value) for key, value in settings if key not in FORMER_BUDGET_SETTINGS]
    allocate = former.get("allocate", "even")
    if allocate not in {a for a, _ in BUDGET_ALIASES}:
        raise ValueError(f"allocate must be one of {tuple(dict.fromkeys(a for a, _ in BUDGET_ALIASES))} in "
                         f"{text.strip()!r}, got {allocate!r} (today: head_budget, layer_budget or global_budget)")
    if "share_heads" in former:
        share_heads = _boolean(former["share_heads"])
        if share_heads is None:
            raise ValueError(f"share_heads must be true or false in {text.strip()!r}, got {former['share_heads']!r}")
    else:  # what the allocation needs
        share_heads = (allocate, True) in BUDGET_ALIASES
    if (allocate, share_heads) not in BUDGET_ALIASES:
        fix = ("global_budget (a budget per KV head across layers)" if allocate == "layers" else
               f"{BUDGET_ALIASES[(allocate, not share_heads)][0]} (each KV head its own tokens)")
        raise ValueError(f"press spec {text.strip()!r}: allocate={allocate} with share_heads="
                         f"{str(share_heads).lower()} names no press; write {fix}")
    name, added = BUDGET_ALIASES[(allocate, share_heads)]
    if "floor" in former:
        if name == "phase_aware" or added:
            raise ValueError(f"press spec {text.strip()!r}: floor is a setting of a budget spread by score, "
                             "head_budget, layer_budget or global_budget (floor=F: each unit first keeps F of its "
                             "even budget)")
        added = (("floor", former["floor"]),)
    return name, rest + list(added)


def respelled(text: str) -> str:
    """The spec ``text`` in today's spelling (:data:`BUDGET_ALIASES` applied, settings sorted, booleans lowercase),
    which :func:`.presses.parse_press_spec` parses; a spec of the older reshaping (:func:`current_spelling`) is only
    sorted and lowercased. ValueError naming the spec for a former budget spelling that named no press, or a
    setting that is not ``key=value``."""
    name, settings = _split(text)
    if name == "phase_aware" and current_spelling(text) == text.strip() \
            and any(key in FORMER_BUDGET_SETTINGS for key, _ in settings):
        name, settings = _respelled_budget(text, settings)
    if name in WRAPPERS:
        settings = [(key, value) for key, value in settings if (key, value) != ("press", WRAPPED)]
    keys = [key for key, _ in settings]
    twice = next((key for i, key in enumerate(keys) if key in keys[:i]), None)
    if twice is not None:
        raise ValueError(f"press spec {text.strip()!r} sets {twice} twice")
    written = [(key, value if _boolean(value) is None else value.lower()) for key, value in settings]
    return ":".join([name] + [f"{key}={value}" for key, value in sorted(written)])


def canonical_label(label: str) -> str:
    """The label of today for a ``press`` label written by any version (:func:`respelled`); today's labels are
    returned as they are."""
    return respelled(label)


PRESS_FIELD = 7
"""Where the press label sits in an answer's key (:func:`.store.record_key`: task, context length, stride, window,
protocol, sample, phase, press, ratio[, setting])."""


def canonical_key(key: str, label: str) -> str:
    """The answer key ``key`` of an answer labelled ``label`` with the label of today in its press field; ValueError
    naming the key when that field is not ``label``."""
    parts = key.split("|")
    if len(parts) <= PRESS_FIELD or parts[PRESS_FIELD] != label:
        raise ValueError(f"answer key {key!r} does not hold its press label {label!r} at field {PRESS_FIELD}")
    today = canonical_label(label)
    if today == label:
        return key
    parts[PRESS_FIELD] = today
    return "|".join(parts)


def canonical_records(df):
    """The answers ``df`` (a DataFrame with ``press`` and ``key`` columns) with today's labels and keys: every
    label through :func:`canonical_label`, every key through :func:`canonical_key`. ``df`` is changed in place and
    returned."""
    if not len(df) or "press" not in df:
        return df
    today = {label: canonical_label(label) for label in df["press"].unique()}
    changed = [label for label, new in today.items() if new != label]
    if changed:
        rows = df["press"].isin(changed)
        df.loc[rows, "key"] = [canonical_key(k, p) for k, p in zip(df.loc[rows, "key"], df.loc[rows, "press"])]
        df["press"] = df["press"].map(today)
    return df


def former_spelling_note(text: str) -> str | None:
    """A line for a spec written in a former spelling of the budget wrappers (:data:`BUDGET_ALIASES`): the spelling
    of today, under which its answers are labelled; None for any other spec."""
    name, settings = _split(text)
    if name != "phase_aware" or current_spelling(text) != text.strip() \
            or not any(key in FORMER_BUDGET_SETTINGS for key, _ in settings):
        return None
    return (f"press spec {text.strip()!r} is spelled {respelled(text)!r} today (the budget wrappers are named like "
            "their classes: head_budget, layer_budget, global_budget); its answers are labelled so")
