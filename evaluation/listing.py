"""``kvpress-phase list``: the task, press and model names the flags accept, and for every press its spec's settings
with their defaults and one example spec.

Everything is read from the registries (:data:`.tasks.TASKS`, :data:`.presses.REGISTRY` with
:func:`.presses.setting_defaults` and :func:`.presses.example_spec`, :data:`kvpress_phase.builtin.BUILTIN_MODELS`,
and the scorers shipped in ``kvpress_phase/scorers/``), never from a copy kept here.
"""

from __future__ import annotations

INDENT = " " * 25
"""Where a press's settings and example line up (under its description)."""


def shown(value) -> str:
    """A default as a spec writes it: ``true``/``false`` for booleans, ``auto`` for None (the press chooses)."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def press_lines() -> list[str]:
    """The presses: name, ``Q`` when it reads the question under ``--query-aware``, description, settings with
    their defaults, an example spec; then what the run sets and which models ``kvzap`` needs."""
    from kvpress_phase.presses.learned_scorer import shipped_scorers
    from kvpress_phase.presses.scorers import SCORERS

    from .presses import (CHUNK_SCORERS, REGISTRY, RUN_SETTINGS, example_spec, parse_press_spec, reads_question,
                          setting_defaults)

    lines = ["presses (Q: reads the question when it is compressed with the context, --query-aware; settings: "
             "key=default, auto = the press chooses; a spec is NAME:key=value:key=value):"]
    in_specs = set()
    for name, entry in REGISTRY.items():
        mark = "Q" if reads_question(parse_press_spec(name)) else " "
        lines.append(f"  {name:<20} {mark} {entry.description}")
        defaults = setting_defaults(name)
        in_specs |= set(defaults)
        settings = ", ".join(f"{key}={shown(value)}" for key, value in defaults.items()) or "none"
        if entry.settings == "scorer":
            settings += f" (one of {', '.join(entry.scorers or CHUNK_SCORERS)})"
        if entry.wraps:
            settings += f" and the settings of {entry.wraps}"
        lines += [f"{INDENT}settings: {settings}", f"{INDENT}e.g. {example_spec(name)}"]
    run = "; ".join(f"{key} by {flag}" + (" (or a spec, where listed above)" if key in in_specs else "")
                    for key, flag in RUN_SETTINGS.items())
    models = " or ".join(f"--model {model}" for model, _ in shipped_scorers().values()) or "a model with a scorer"
    lines += [f"  set by the run's flags: {run}",
              f"  scorer= of our presses: {', '.join(SCORERS)}",
              f"  kvzap and scorer=kvzap use the scorer shipped for the model: {models} "
              "(`kvpress-phase train-scorer` trains one for another model, for use from Python)"]
    return lines


def listing() -> str:
    """The whole text of ``kvpress-phase list``."""
    from kvpress_phase.builtin import BUILTIN_MODELS, DEFAULT_MODEL

    from .tasks import TASKS

    lines = ["tasks:"]
    lines += [f"  {name:<20} {spec.family:<9} {spec.description}" for name, spec in TASKS.items()]
    lines += press_lines()
    lines.append("models (--model):")
    for name, entry in BUILTIN_MODELS.items():
        status = "" if entry.available else f" [not available yet: {entry.build_command}]"
        default = " (default)" if name == DEFAULT_MODEL else ""
        lines.append(f"  {name:<20} {entry.size}, {entry.licence}: {entry.description}{default}{status}")
    return "\n".join(lines)
