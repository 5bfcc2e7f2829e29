"""The evaluation's answers on the storage users get against a committed run decoded on masked layers.

Until 2026-12-06 the replay decoded the per-head presses of this package (``global_budget``, ``head_budget``) on
dense layers with their shorter heads' padding masked, and wrote ``cache_bytes`` from a formula; since then it stores
them as kvpress's pipeline does (each KV head only its own entries, :func:`kvpress_phase.presses.storage.store_layer`),
decodes them there and measures the bytes. This script joins a fresh run of such a press with a committed run of the
same configuration by answer key and reports: the answers compared, those that differ (each with both predictions and
the reference), and the bytes, committed (formula) against measured.

    kvpress-phase eval --model smollm2 --tasks niah_single,niah_multikey --presses global_budget:scorer=kvzap \\
        --compression-ratios 0.25,0.5,0.75 --strides 7 --protocol offset --context-lengths 1024 --samples 8 \\
        --seed 53 --matched-cache --no-diagnostics --output-dir outputs/ragged-replay-check
    python -m studies.ragged_replay_check outputs/regimes-test/smollm2/agnostic-1024 outputs/ragged-replay-check \\
        --output docs/results/ragged-replay-check.md
"""

from __future__ import annotations

import argparse
import os
import sys

import pandas as pd

from studies.common import emit, load_runs


def answers(run_dir: str) -> pd.DataFrame:
    """A run's answers (packed or not), one row per answer key."""
    frame, _ = load_runs([run_dir])
    return frame.drop_duplicates("key").set_index("key")


def compare(committed: pd.DataFrame, fresh: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The answers of ``fresh`` that ``committed`` also has, side by side, and the lines of the report."""
    joined = fresh.join(committed, how="inner", lsuffix="_ragged", rsuffix="_masked")
    if joined.empty:
        raise ValueError("the two runs share no answer key: run the same configuration (seed, tasks, strides, "
                         "ratios, lengths, samples, protocol, --matched-cache)")
    differ = joined[joined["prediction_ragged"] != joined["prediction_masked"]]
    ratio = joined["cache_bytes_ragged"] / joined["cache_bytes_masked"]
    lines = [f"Answers compared: {len(joined):,} (presses: {', '.join(sorted(joined['press_ragged'].unique()))}).",
             f"Identical predictions: {len(joined) - len(differ):,}; different: {len(differ):,}.",
             f"Scores: masked {joined['score_masked'].mean():.4f}, ragged {joined['score_ragged'].mean():.4f}.",
             f"Bytes, measured on the ragged cache over the committed formula: mean {ratio.mean():.4f}, "
             f"range {ratio.min():.4f}-{ratio.max():.4f}."]
    if len(differ):
        lines += ["", "| key | masked | ragged | reference |", "|---|---|---|---|"]
        for key, row in differ.iterrows():
            lines.append(f"| `{key}` | {row['prediction_masked']!r} | {row['prediction_ragged']!r} | "
                         f"{list(row['answer_masked'])!r} |")
    return joined, lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("committed", help="a committed run's directory (decoded masked)")
    parser.add_argument("fresh", help="the same configuration run today (decoded ragged)")
    parser.add_argument("--output", help="write the report to this Markdown file")
    args = parser.parse_args(argv)
    for path in (args.committed, args.fresh):
        if not os.path.isdir(path):
            print(f"error: {path} is not a run directory", file=sys.stderr)
            return 2
    try:
        _, lines = compare(answers(args.committed), answers(args.fresh))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    emit("\n".join(lines), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
