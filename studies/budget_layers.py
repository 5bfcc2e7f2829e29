"""Where a budget over the model spends its entries, and whether the answer's tokens survive in each layer.

For a few texts of one task, placed at every phase of one stride (the offset protocol, as the studies run it), each
press compresses the prefill once per phase; from ``press.stats`` it reads, per layer, how many entries are attended
(a masked head's padding not counted) and which share of the answer's tokens is still attended (in any KV head, and
averaged over the KV heads). Written for R7's question why the dense budget over layers
(``layer_budget:scorer=kvzap``) misses at ratio 0.75 on ``niah_single`` where the global one does not:

    python -m studies.budget_layers --model smollm2 --task niah_single --context-length 1024 --stride 5 \\
        --compression-ratio 0.75 --samples 4 --seed 17 \\
        --presses phase_aware,layer_budget:scorer=kvzap,global_budget:scorer=kvzap \\
        --output docs/results/learned/budget-layers.md

It writes a Markdown table per press (layer by layer) and a plot beside the Markdown (``.png``). It answers nothing:
a cache that keeps the answer's tokens can still be answered wrongly, and one that drops them can still be answered
from the question's own tokens; the studies' answers are the accuracy, this is the mechanism.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import numpy as np
import pandas as pd


def kept_answer(stats, start: int, end: int) -> tuple[int, float, float, float]:
    """``(attended entries of the longest head, mean over heads, share of answer tokens attended by any head, mean
    share over heads)`` of one layer's record; an uncompressed layer keeps everything."""
    if stats.positions is None:
        return stats.seq_len, float(stats.seq_len), 1.0, 1.0
    positions = stats.positions[0].long()  # (heads, entries)
    ends = stats.ends[0].long() if stats.ends is not None else positions + 1
    attended = np.ones(tuple(positions.shape), dtype=bool)
    if stats.masked is not None:
        heads, seq = stats.masked
        attended[np.asarray(heads), np.asarray(seq)] = False
    tokens = np.arange(start, end)
    per_head = []
    for h in range(positions.shape[0]):
        p, e = positions[h].numpy()[attended[h]], ends[h].numpy()[attended[h]]
        covered = ((tokens[:, None] >= p[None]) & (tokens[:, None] < e[None])).any(axis=1)
        per_head.append(covered)
    per_head = np.array(per_head)  # (heads, answer tokens)
    counts = attended.sum(axis=1)
    return int(counts.max()), float(counts.mean()), float(per_head.any(axis=0).mean()), float(per_head.mean())


def measure(model, tokenizer, presses: list[str], task: str, context_length: int, stride: int, ratio: float,
            samples: int, seed: int, progress: bool = True) -> pd.DataFrame:
    """One row per (press, sample, phase, layer): attended entries and the answer's share kept."""
    import torch
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from evaluation.presses import build_press, parse_press_spec
    from evaluation.prompting import context_token_ids
    from evaluation.tasks import generate

    specs = [parse_press_spec(p) for p in presses]
    rows_in = generate(task, tokenizer, n_samples=samples, context_length=context_length, stride=stride,
                       phases=range(stride), protocol="offset", seed=seed)
    out = []
    with torch.inference_mode():
        for row in tqdm(list(rows_in), desc="budget layers", unit="compress step", disable=not progress):
            ids = torch.tensor([context_token_ids(tokenizer, row["context"])])
            start, end = row["answer_token_start"], row["answer_token_end"]
            for spec in specs:
                press = build_press(spec, ratio, stride, None, row["offset"], matched_context_length=ids.shape[1])
                with press(model):
                    model(input_ids=ids, past_key_values=DynamicCache())
                for layer, stats in sorted(press.stats.items()):
                    entries, head_entries, any_head, mean_head = kept_answer(stats, start, end)
                    out.append({"press": spec.label, "sample_id": row["sample_id"], "phase": row["phase"],
                                "layer": layer, "entries": entries, "head_entries": head_entries,
                                "answer_any_head": any_head,
                                "answer_mean_head": mean_head, "seq_len": stats.seq_len})
    return pd.DataFrame(out)


def to_markdown(table: pd.DataFrame, title: str) -> str:
    lines = [f"# {title}", ""]
    means = table.groupby(["press", "layer"])[["entries", "head_entries", "answer_any_head",
                                                "answer_mean_head"]].mean()
    for press, part in means.groupby(level="press", sort=False):
        per_text = table[table.press == press].groupby(["sample_id", "phase"])
        none_kept = per_text.answer_any_head.apply(lambda s: int((s == 0).sum())).mean()
        total = table[table.press == press].groupby(["sample_id", "phase"]).head_entries.sum().mean()
        lines += [f"## `{press}`", "", f"Attended entries per KV head, summed over layers: {total:.0f}. Layers where "
                  f"no head attends any answer token: {none_kept:.1f} of {table.layer.nunique()} per text (means over "
                  "texts and phases).", "",
                  "| layer | attended entries, longest head | mean over heads | answer tokens kept, any head | "
                  "mean over heads |", "|---|---|---|---|---|"]
        for (_, layer), r in part.iterrows():
            lines.append(f"| {layer} | {r.entries:.0f} | {r.head_entries:.0f} | {r.answer_any_head:.2f} | "
                         f"{r.answer_mean_head:.2f} |")
        lines.append("")
    return "\n".join(lines)


def plot(table: pd.DataFrame, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    for press, part in table.groupby("press", sort=False):
        means = part.groupby("layer")[["head_entries", "answer_any_head"]].mean()
        axes[0].plot(means.index, means.head_entries, marker="o", label=press)
        axes[1].plot(means.index, means.answer_any_head, marker="o", label=press)
    axes[0].set(xlabel="layer", ylabel="attended entries (mean over KV heads)")
    axes[1].set(xlabel="layer", ylabel="share of answer tokens kept (any head)", ylim=(-0.05, 1.05))
    axes[1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--task", default="niah_single")
    parser.add_argument("--context-length", type=int, default=1024)
    parser.add_argument("--stride", type=int, default=5)
    parser.add_argument("--compression-ratio", type=float, default=0.75)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--presses", required=True, help="comma-separated press specs, as `kvpress-phase eval`")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", help="write the Markdown here (and the plot beside it, .png)")
    args = parser.parse_args(argv)
    import torch

    from evaluation.cli import UsageError, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    if not 0 < args.compression_ratio < 1:
        print(f"budget_layers: error: --compression-ratio must be in (0, 1), got {args.compression_ratio}",
              file=sys.stderr)
        return 2
    try:
        model, tokenizer = load_model(args.model, "cpu", "float32")
        table = measure(model, tokenizer, [p for p in args.presses.split(",") if p], args.task, args.context_length,
                        args.stride, args.compression_ratio, args.samples, args.seed)
    except (UsageError, ValueError) as exc:
        print(f"budget_layers: error: {exc}", file=sys.stderr)
        return 2
    title = (f"{args.model}, {args.task}, {args.context_length} tokens, stride {args.stride}, ratio "
             f"{args.compression_ratio:g}, seed {args.seed}, {args.samples} texts x {args.stride} phases")
    text = to_markdown(table, title)
    print(text)
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as fh:
            fh.write(text)
        plot(table, os.path.splitext(args.output)[0] + ".png", title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
