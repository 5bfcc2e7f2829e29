"""kvpress's KVzap with a scorer from a local folder: :func:`load_scorer` and :class:`LocalKVzapPress`.

A KVzap scorer (``kvpress.presses.kvzap_press.KVzapModel``, one linear map or small MLP per layer from the layer's
attention input to a log KVzip+ score per KV head) is tied to one model's shapes. kvpress's ``KVzapPress`` fetches
``nvidia/KVzap-<type>-<model>`` from the hub in ``post_init_from_model``; :class:`LocalKVzapPress` loads the folder
``scorer_path`` there instead (``kvpress-phase train-scorer`` writes such folders), after checking that the scorer
was trained for a model of the same shape. Everything else (the scores, the compression) is kvpress's.

    press = LocalKVzapPress(compression_ratio=0.5, scorer_path="outputs/scorer/mlp")
    press = scorer_press("outputs/scorer/mlp", threshold=-6.0)   # kvpress's DMSPress around it
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional


from kvpress import DMSPress
from kvpress.presses.kvzap_press import KVzapModel, KVzapPress

from kvpress_phase.builtin import SCORERS_DIR, scorer_models

SOURCE_FIELDS = ("num_hidden_layers", "hidden_size", "num_key_value_heads")
"""The source model's numbers a scorer's config records (as ``source_<field>``) and :func:`check_scorer` compares."""


def model_shape(model) -> dict:
    """``{field: value}`` of :data:`SOURCE_FIELDS` for a loaded causal LM (its text config for multimodal ones)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return {f: int(getattr(config, f)) for f in SOURCE_FIELDS}


def _describe(name: str, shape: dict) -> str:
    return (f"{name} ({shape['num_hidden_layers']} layers, hidden size {shape['hidden_size']}, "
            f"{shape['num_key_value_heads']} KV heads)")


def scorer_shape(scorer: KVzapModel) -> dict:
    """The model shape a scorer fits: the recorded source numbers, or else its module count and dimensions."""
    c = scorer.config
    own = {"num_hidden_layers": c.n_modules, "hidden_size": c.input_dim, "num_key_value_heads": c.output_dim}
    return {f: int(getattr(c, f"source_{f}", own[f])) for f in SOURCE_FIELDS}


def check_scorer(scorer: KVzapModel, model, where: str = "the scorer") -> None:
    """ValueError naming both models and their numbers when ``scorer`` was not trained for a model shaped like
    ``model`` (number of layers, hidden size, KV heads)."""
    have, want = scorer_shape(scorer), model_shape(model)
    c = scorer.config
    own = (c.n_modules, c.input_dim, c.output_dim)
    if have != want or own != tuple(want[f] for f in SOURCE_FIELDS):
        source = getattr(c, "source_model", None) or "another model"
        target = getattr(model.config, "name_or_path", "") or type(model).__name__
        raise ValueError(f"{where} was trained for {_describe(repr(source), have)}, not for "
                         f"{_describe(repr(target), want)}; train one for this model with "
                         "`kvpress-phase train-scorer`")


def load_scorer(path: str, model) -> KVzapModel:
    """The KVzap scorer saved in the folder ``path`` (``KVzapModel.save_pretrained``), checked against ``model``
    (:func:`check_scorer`); ValueError when it cannot be read or was trained for another model."""
    from kvpress_phase.builtin import quiet_loading

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path!r} is not a scorer folder (it has no config.json); `kvpress-phase train-scorer` "
                         "writes them into <output-dir>/linear and <output-dir>/mlp")
    try:
        with quiet_loading():
            scorer = KVzapModel.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"the scorer {path!r} cannot be loaded: {exc}") from None
    check_scorer(scorer, model, where=f"the scorer {path!r}")
    return scorer.eval()


SHIPPED = SCORERS_DIR
"""The folder of the scorers shipped in the package, one sub-folder per model (``kvpress_phase/scorers/``)."""


def shipped_scorers() -> dict:
    """``{folder: (model name, shape)}`` of the scorers shipped in :data:`SHIPPED`: the ``--model`` name each was
    trained on (its config's ``source_model``) and the shape it fits (:data:`SOURCE_FIELDS`)."""
    from kvpress.presses.kvzap_press import KVzapConfig

    found = {}
    for model, path in scorer_models().items():
        config = KVzapConfig.from_pretrained(path)
        found[os.path.basename(path)] = (model, {f: int(getattr(config, f"source_{f}")) for f in SOURCE_FIELDS})
    return dict(sorted(found.items()))


def shipped_scorer_path(model) -> str:
    """The folder of the shipped scorer trained for a model shaped like ``model``; ValueError naming the model's
    shape, the models the scorers ship for, and ``train-scorer`` when there is none."""
    want = model_shape(model)
    shipped = shipped_scorers()
    for folder, (_, shape) in shipped.items():
        if shape == want:
            return os.path.join(SHIPPED, folder)
    target = getattr(model.config, "name_or_path", "") or type(model).__name__
    names = [name for name, _ in shipped.values()]
    models = " and ".join(_describe(name, shape) for name, shape in shipped.values()) or "no model"
    use = (f"use one of those models (--model {' or --model '.join(names)}; in Python load_builtin_model(name=...)), "
           "or " if names else "")
    raise ValueError(f"no shipped KVzap scorer fits {_describe(repr(target), want)}; scorers ship for {models}: "
                     f"{use}train a scorer for this model with `kvpress-phase train-scorer --model NAME "
                     "--output-dir DIR` and use it from Python, LocalKVzapPress(scorer_path='DIR/linear') (also as "
                     "scorer= of PhaseAwarePress); an evaluation press spec (kvzap, scorer=kvzap) loads only a "
                     "shipped scorer")


@dataclass
class LocalKVzapPress(KVzapPress):
    """kvpress's ``KVzapPress`` with its scorer read from the folder ``scorer_path`` (see :func:`load_scorer`)
    rather than from the hub; ``model_type`` follows the loaded scorer (``linear`` or ``mlp``). Without
    ``scorer_path`` it uses the scorer shipped for the model's shape (:func:`shipped_scorer_path`); a model with none
    is refused by name. Its scores are one log KVzip+ score per entry on one scale for every layer and KV head, so
    budgets across layers (:mod:`kvpress_phase.presses.budget`) can rank them; as a scorer of our presses it is
    ``scorer="kvzap"``."""

    scorer_path: Optional[str] = None

    def scorer_folder(self, model) -> str:
        """The folder the scorer is read from: ``scorer_path``, else the one shipped for ``model``."""
        return self.scorer_path or shipped_scorer_path(model)

    def post_init_from_model(self, model):
        path = self.scorer_folder(model)
        if self.kvzap_model_name != path:
            self.kvzap_model = load_scorer(path, model)
            self.kvzap_model_name = path  # what KVzapPress compares: the hub is never asked
            self.model_type = "linear" if self.kvzap_model.config.hidden_dim is None else "mlp"
        else:  # loaded before, maybe for another model
            check_scorer(self.kvzap_model, model, where=f"the scorer {path!r}")

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        if getattr(self, "kvzap_model", None) is None:
            raise ValueError("LocalKVzapPress loads its scorer in post_init_from_model(model): use the press as a "
                             "context manager (`with press(model): ...`) or through kvpress's pipeline")
        return super().score(module, hidden_states, keys, values, attentions, kwargs)


MLP_FOLDER = "mlp"
"""The sub-folder of a shipped scorer's folder that holds the two-layer MLP scorer trained beside it."""


@dataclass
class LocalKVzapMLPPress(LocalKVzapPress):
    """:class:`LocalKVzapPress` with the two-layer MLP scorer shipped for the model (``Linear(h, h/8) -> GELU ->
    Linear(h/8, KV heads)``, trained by ``kvpress-phase train-scorer --arch both`` on the same training passages as
    the linear one; kvpress's own evaluation calls its hub MLP ``kvzap_mlp_head``). As a scorer of our presses it is
    ``scorer="kvzap_mlp"``; ``scorer_path`` still names any folder."""

    def scorer_folder(self, model) -> str:
        return self.scorer_path or os.path.join(shipped_scorer_path(model), MLP_FOLDER)


THRESHOLDS = "thresholds.json"
"""The file beside a scorer's weights that holds its score quantiles (``kvpress-phase calibrate-scorer`` writes it):
what turns a share of entries to keep into a score threshold (:class:`ScoreQuantiles`)."""


@dataclass(frozen=True)
class ScoreQuantiles:
    """A scorer's scores on its calibration text, as quantiles: ``values[i]`` is the quantile at ``levels[i]`` of
    every score (every layer, KV head and position of the calibration passages pooled; the learned scores are on one
    scale). :meth:`threshold` is the score above which a share ``keep`` of the entries lies on that text."""

    levels: tuple
    values: tuple
    path: str = ""

    def __post_init__(self):
        if len(self.levels) < 2 or len(self.levels) != len(self.values):
            raise ValueError(f"{self.path or 'score quantiles'}: levels and values must be two lists of the same "
                             f"length >= 2, got {len(self.levels)} and {len(self.values)}")
        if list(self.levels) != sorted(self.levels) or self.levels[0] != 0 or self.levels[-1] != 1:
            raise ValueError(f"{self.path or 'score quantiles'}: levels must rise from 0 to 1")
        if list(self.values) != sorted(self.values):
            raise ValueError(f"{self.path or 'score quantiles'}: the quantile values must not decrease")

    def threshold(self, keep: float) -> float:
        """The score that a share ``keep`` (in ``[0, 1]``) of the calibration scores exceeds (linear between the
        stored quantiles)."""
        import numpy as np

        if not 0 <= keep <= 1:
            raise ValueError(f"keep must be in [0, 1], got {keep!r}")
        return float(np.interp(1.0 - keep, self.levels, self.values))

    @classmethod
    def load(cls, folder: str) -> "ScoreQuantiles":
        """The quantiles saved beside the scorer in ``folder``; ValueError naming the command that writes them."""
        path = os.path.join(folder, THRESHOLDS)
        if not os.path.isfile(path):
            raise ValueError(f"the scorer {folder!r} has no {THRESHOLDS} (its score quantiles on calibration text): "
                             "write it with `kvpress-phase calibrate-scorer --model NAME --scorer "
                             f"{folder}`, or give the press an explicit threshold=")
        try:
            with open(path) as fh:
                data = json.load(fh)
            return cls(tuple(data["levels"]), tuple(data["quantiles"]), path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path} cannot be read as score quantiles: {exc}") from None


def scorer_press(path: str, compression_ratio: float = 0.0, threshold: Optional[float] = None,
                 sliding_window_size: int = 128):
    """A ready press from the scorer folder ``path``: :class:`LocalKVzapPress` pruning ``compression_ratio`` of
    every head's entries, or, with ``threshold``, kvpress's ``DMSPress`` around it (every entry scored below the
    threshold evicted, the last ``sliding_window_size`` tokens kept), as kvpress pairs KVzap."""
    press = LocalKVzapPress(compression_ratio=compression_ratio if threshold is None else 0.0, scorer_path=path)
    if threshold is None:
        return press
    return DMSPress(press, threshold=threshold, sliding_window_size=sliding_window_size)


__all__ = ["LocalKVzapPress", "ScoreQuantiles", "THRESHOLDS", "check_scorer", "load_scorer", "model_shape", "scorer_press", "shipped_scorer_path",
           "shipped_scorers"]
