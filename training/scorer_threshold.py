"""A KVzap scorer's score quantiles on calibration text: what ``ThresholdBudgetPress`` and the DMS baseline read.

A budget decided layer by layer (:class:`~kvpress_phase.presses.ablations.ThresholdBudgetPress`, kvpress's ``DMSPress``) keeps the
entries whose learned score exceeds a threshold. The learned KVzip+ scores are on one scale for every layer and KV
head, so one threshold per share of entries kept serves the whole model: the score that share of the scores exceeds
on calibration text. :func:`calibrate` computes the quantiles of every score (every layer, KV head and position
pooled) on

- the scorer's validation passages: the first ``passages`` validation documents of the scorer's text
  (:mod:`.text_corpus`), ``passage_tokens`` tokens each, chosen as ``train-scorer`` chooses them, so the same ones;
- ``prompts`` contexts of the evaluation's generators (``niah_single`` and ``niah_multikey`` alternately, seed
  ``prompt_seed``, 0 by default as the scorer card's prompts; the studies' dev and test seeds are others),

and :func:`write` saves them as ``thresholds.json`` beside the scorer's weights
(:data:`~kvpress_phase.presses.learned_scorer.THRESHOLDS`, read by
:class:`~kvpress_phase.presses.learned_scorer.ScoreQuantiles`), with each source's own quantiles for comparison.

    kvpress-phase calibrate-scorer --model smollm2
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import numpy as np
import torch
from kvpress import BasePress

LEVELS = 1001
"""Quantiles stored: levels 0, 0.001, ..., 1."""
SUMMARY_LEVELS = (0.25, 0.5, 0.75, 0.9)


class _Recorder(BasePress):
    """Records the scorer's scores of every layer during a prefill and compresses nothing (kvpress's hooks)."""

    def __init__(self, scorer):
        self.scorer, self.scores = scorer, {}

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        self.scores[module.layer_idx] = self.scorer.score(module, hidden_states, keys, values, attentions,
                                                          kwargs).float()[0].cpu()
        return keys, values


def passage_scores(model, scorer, ids: list) -> torch.Tensor:
    """``(layers, kv_heads, len(ids))`` float32: the scorer's scores of one prefill of ``ids``."""
    recorder = _Recorder(scorer)
    with torch.no_grad(), recorder(model):
        model.model(torch.tensor([ids], device=model.device))
    return torch.stack([recorder.scores[i] for i in sorted(recorder.scores)])


def calibration_items(tokenizer, *, passages: int, passage_tokens: int, prompts: int, prompt_length: int,
                      prompt_seed: int, progress: bool = True) -> dict:
    """``{"text": [(name, ids)], "prompts": [(name, ids)]}``: the calibration passages (module docstring)."""
    from . import text_corpus
    from .scorer import eval_prompts, select_passages

    items = {"text": [], "prompts": []}
    if passages:
        corpus = text_corpus.load_corpus(progress=progress)
        items["text"] = select_passages(corpus.split("validation"), passages, tokenizer, passage_tokens)
        if not items["text"]:
            raise ValueError(f"the validation documents hold no passage of {passage_tokens} tokens")
    items["prompts"] = eval_prompts(tokenizer, prompts, prompt_length, prompt_seed)
    if not items["text"] and not items["prompts"]:
        raise ValueError("calibration needs --passages or --prompts above 0")
    return items


def quantiles(values: np.ndarray, levels: int = LEVELS) -> list:
    return [float(v) for v in np.quantile(values, np.linspace(0.0, 1.0, levels))]


def calibrate(model, scorer, items: dict, progress: bool = True) -> dict:
    """The thresholds file's content: pooled quantiles of every score of ``items`` (:func:`calibration_items`)
    under ``scorer`` (a loaded KVzap press), and each source's summary."""
    from tqdm.auto import tqdm

    pooled, sources = [], {}
    todo = [(source, name, ids) for source, entries in items.items() for name, ids in entries]
    for source, name, ids in tqdm(todo, desc="calibrating", unit="passage", disable=not progress, dynamic_ncols=True):
        scores = passage_scores(model, scorer, ids).flatten().numpy().astype(np.float64)
        pooled.append(scores)
        entry = sources.setdefault(source, {"names": [], "tokens": 0, "scores": []})
        entry["names"].append(name)
        entry["tokens"] += len(ids)
        entry["scores"].append(scores)
    for entry in sources.values():
        values = np.concatenate(entry.pop("scores"))
        entry["quantiles_at"] = {f"{q:g}": float(np.quantile(values, q)) for q in SUMMARY_LEVELS}
    every = np.concatenate(pooled)
    return {"levels": [float(x) for x in np.linspace(0.0, 1.0, LEVELS)], "quantiles": quantiles(every),
            "scores": int(every.size), "sources": sources}


def _sha256(path: str) -> Optional[str]:
    if not os.path.isfile(path):
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write(table: dict, scorer_folder: str, *, model_name: str, settings: dict, command: str,
          output: Optional[str] = None) -> str:
    """Save ``table`` (:func:`calibrate`) with what produced it; returns the path (default: the scorer folder's
    ``thresholds.json``). Written to a temporary file and renamed, so a killed run leaves the old file."""
    from importlib.metadata import version

    from kvpress_phase.presses.learned_scorer import THRESHOLDS

    path = output or os.path.join(scorer_folder, THRESHOLDS)
    record = {"model": model_name, "scorer": os.path.basename(os.path.normpath(scorer_folder)),
              "scorer_sha256": _sha256(os.path.join(scorer_folder, "model.safetensors")),
              "pooled": "every layer, KV head and position of every calibration passage", "settings": settings,
              "command": command, "versions": {name: version(name) for name in ("kvpress", "transformers", "torch")},
              **table}
    tmp = f"{path}.partial"
    with open(tmp, "w") as fh:
        json.dump(record, fh, indent=1)
        fh.write("\n")
    os.replace(tmp, path)
    return path


__all__ = ["LEVELS", "calibrate", "calibration_items", "passage_scores", "write"]
