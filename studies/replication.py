"""The verdicts of the second-model replication (``docs/preregistration-second-model.md``), claim by claim.

    python -m studies.replication --main outputs/qwen-replication/agnostic outputs/qwen-replication/question \\
        --audit outputs/qwen-replication/audit-L20 outputs/qwen-replication/audit-L8 \\
        --output docs/results/qwen/verdicts.md \\
        --reference outputs/real-test/agnostic-1024 outputs/real-test/question-1024 --figure docs/results/qwen/profiles.png

Every claim is read by the rule the pre-registration wrote for it, from the cells' permutation p-values (Holm over the
family the claim names), the cells' means and the paired differences by sample (:mod:`studies.common`). A verdict is
``replicated``, ``not replicated`` or ``undetectable at this sample size``; a cell is *at the floor* (a 0.55 drop
cannot show) where the press's mean is below 0.25 or ``no_press`` answers its task below 0.5. Claims whose runs are
not given read ``not run``, and claims whose cells are still answering read ``incomplete``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import numpy as np
import pandas as pd

from kvpress_phase.evaluation.metrics import holm, summarize
from kvpress_phase.evaluation.presses import parse_press_spec

from studies.common import ALL_BASELINES, baseline_labels, emit, fmt_p, load, paired, paired_pooled
from studies.targets import CELL, targets

ALPHA = 0.05
FLOOR_MEAN, FLOOR_NO_PRESS = 0.25, 0.5
SAMPLES, AUDIT_CELLS = 16, 6  # the pre-registration's samples per phase, and the audit family's size
D = "phase_aware:scorer=kvzap:allocate=layers"
G = "phase_aware:scorer=kvzap:allocate=layers_heads:share_heads=false"
NOT_RUN = "not run"


def label(spec: str) -> str:
    return parse_press_spec(spec).label


def with_floor(records: pd.DataFrame) -> pd.DataFrame:
    """``records`` (one row per cell and press) with ``no_press`` (that task's uncompressed mean in the same setting,
    length and stride), ``at_floor`` and the weakest phase."""
    full = records[records.press == "no_press"].set_index(["setting", "task", "context_length", "stride"])["mean"]
    out = records[records.compression_ratio > 0].copy()
    out["no_press"] = [full.get((r.setting, r.task, r.context_length, r.stride), np.nan) for r in out.itertuples()]
    out["at_floor"] = (out["mean"] < FLOOR_MEAN) | (out["no_press"] < FLOOR_NO_PRESS)
    out["weakest"] = [int(np.nanargmin(np.asarray([np.nan if x is None else x for x in p], float)))
                      if p is not None and len(p) and not all(x is None for x in p) else -1 for p in out.per_phase]
    return out


def family(records: pd.DataFrame, cells: pd.Series) -> pd.DataFrame:
    """The rows ``cells`` selects, with the Holm-adjusted p over them (a cell without a p counts as p = 1)."""
    part = records[cells].copy()
    part["p_holm"] = holm(part.p_value.fillna(1.0).to_numpy()) if len(part) else []
    return part


def unfinished(cells: pd.DataFrame, expected: Optional[int] = None) -> Optional[str]:
    """Why ``cells`` are not yet the finished runs' cells (fewer than ``expected`` cells, a phase without answers, or
    fewer than ``SAMPLES`` samples), or None when they are."""
    if expected is not None and len(cells) < expected:
        return f"{len(cells)} of {expected} cells answered"
    short = [r for r in cells.itertuples()
             if getattr(r, "n_samples", SAMPLES) < SAMPLES or any(x is None for x in r.per_phase)]
    return f"{len(short)} of {len(cells)} cells still answering" if short else None


def mark_incomplete(rows: list[dict], why: Optional[str]) -> list[dict]:
    for row in rows:
        if why:
            row["verdict"] = f"incomplete ({why}; reads {row['verdict']} so far)"
    return rows


def audit_claims(records: Optional[pd.DataFrame]) -> list[dict]:
    """A1-A3 over the six audit cells, Holm over the six ("incomplete" until all six have every sample)."""
    if records is None:
        return [{"claim": c, "verdict": NOT_RUN, "evidence": ""} for c in ("A1", "A2", "A3")]
    keydiff, knorm, chunkkv = label("chunk:scorer=keydiff"), label("chunk"), label("chunkkv")
    cells = ((records.press == keydiff) & (records.stride == 20) & np.isclose(records.compression_ratio, 0.125)) | \
            ((records.press == knorm) & (records.stride == 8) & np.isclose(records.compression_ratio, 0.25)) | \
            ((records.press == chunkkv) & (records.stride == 20) & np.isclose(records.compression_ratio, 0.125))
    fam = family(records, cells)

    def show(part):
        return "; ".join(f"{r.task} mean {r.mean:.2f}, p {fmt_p(r.p_value)}, Holm {fmt_p(r.p_holm)}"
                         f"{' (floor)' if r.at_floor else ''}" for r in part.itertuples()) or "no cells"

    a1 = fam[fam.press == keydiff]
    if (a1.p_holm < ALPHA).any():
        v1 = "replicated"
    elif len(a1) == 2 and not a1.at_floor.any():
        v1 = "not replicated"
    else:
        v1 = "undetectable at this sample size"
    a2 = fam[(fam.press == knorm) & (fam.task == "niah_multikey")]
    if len(a2) and (a2.p_holm < ALPHA).any():
        v2 = "replicated"
    elif len(a2) and not a2.at_floor.any():
        v2 = "not replicated"
    else:
        v2 = "undetectable at this sample size"
    a3 = fam[fam.press == chunkkv]
    v3 = "new finding: weak phases" if (a3.p_holm < ALPHA).any() else "no phase effect detected (reported)"
    return mark_incomplete([{"claim": "A1", "verdict": v1, "evidence": show(a1)},
                            {"claim": "A2", "verdict": v2, "evidence": show(a2)},
                            {"claim": "A3", "verdict": v3, "evidence": show(a3)}], unfinished(fam, AUDIT_CELLS))


def r1_claims(records: pd.DataFrame, baselines: list[str]) -> list[dict]:
    """B1-B3 over the 16 cells at ratios 0.25 and 0.5 (``records``: every cell and press, ``no_press`` included)."""
    floored = with_floor(records)
    low = floored[floored.compression_ratio <= 0.5 + 1e-9]
    chunked = family(low, low.press == "chunked_stride")
    hit = chunked[(chunked.p_holm < ALPHA) & (chunked.weakest != 0) & (chunked.weakest != chunked.stride - 1)]
    readable = int((~chunked.at_floor & (chunked["mean"] < 1.0)).sum())
    if len(hit):
        b1 = "replicated"
    elif not (chunked.p_holm < ALPHA).any() and readable >= 4:
        b1 = "not replicated"
    else:
        b1 = "undetectable at this sample size"
    significant = chunked[chunked.p_holm < ALPHA]
    cells = ", ".join(f"{r.task} {r.setting} S={r.stride} r={r.compression_ratio:g}: weakest phase {r.weakest}, "
                      f"Holm {fmt_p(r.p_holm)}" for r in significant.itertuples())
    ev1 = (f"{len(significant)} of {len(chunked)} cells Holm p < 0.05 ({cells or 'none'}), {len(hit)} with the weakest "
           f"phase inside the window; {readable} cells neither at the floor nor at 1.00")
    flat = family(low, low.press == "phase_aware")
    b2 = "replicated" if len(flat) and not (flat.p_holm < ALPHA).any() else "not replicated"
    ev2 = f"smallest Holm p {fmt_p(flat.p_holm.min() if len(flat) else None)} over {len(flat)} cells"
    t = targets(records[records.compression_ratio <= 0.5 + 1e-9], "phase_aware", "chunked_stride", baselines)
    t2 = t["t2"].dropna()
    b3 = "replicated" if len(t2) and t2.mean() >= 0.8 else ("not replicated" if len(t2) else
                                                             "undetectable at this sample size")
    ev3 = f"met in {int(t2.sum())} of {len(t2)} cells where chunked_stride loses 0.10 or more"
    return [{"claim": "B1", "verdict": b1, "evidence": ev1}, {"claim": "B2", "verdict": b2, "evidence": ev2},
            {"claim": "B3", "verdict": b3, "evidence": ev3}]


def interval(d: dict) -> str:
    text = f"{d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"
    equal = d.get("equal")
    return text if equal is None else (f"{text} (equal cell weights {equal['diff']:+.3f} [{equal['low']:+.3f}, "
                                       f"{equal['high']:+.3f}])")


def both_settings(results: pd.DataFrame, press: str, against: str) -> dict:
    """``press`` minus ``against`` pooled over ratios, per setting (:func:`~studies.common.paired_pooled`): every
    answer weighing the same (the pre-registered reading), with every cell weighing the same beside it
    (``"equal"``)."""
    return {s: {**paired_pooled(part, press, against), "equal": paired_pooled(part, press, against, equal_cells=True)}
            for s, part in results.groupby("setting")}


def comparison_claims(records: pd.DataFrame, results: pd.DataFrame, baselines: list[str]) -> list[dict]:
    """C1-C4 and T1 of every design over the 24 cells; C2-C4 need both settings ("incomplete" until both answered)."""
    t = targets(records, "phase_aware", "chunked_stride", baselines)
    low = t[np.isclose(t.ratio, 0.25)]["t3"].dropna()
    c1 = "replicated" if len(low) and low.mean() >= 0.8 else "not replicated"
    out = [{"claim": "C1", "verdict": c1, "evidence": f"within 0.03 of the best baseline in {int(low.sum())} of "
                                                       f"{len(low)} ratio-0.25 cells"}]
    table = paired(results, "phase_aware")
    kv = table[(table.press == "kvzip") & np.isclose(table.ratio, 0.75)]
    above = [r.low > 0 for r in kv.itertuples()]
    c2 = "replicated" if above and all(above) else ("not replicated" if above and not any(above) else "split")
    high = results[np.isclose(results.compression_ratio, 0.75)]
    equal = {s: paired_pooled(part, "kvzip", "phase_aware", equal_cells=True) for s, part in high.groupby("setting")
             if {"kvzip", "phase_aware"} <= set(part.press)}
    out.append({"claim": "C2", "verdict": c2, "evidence": "; ".join(
        f"{r.setting}: kvzip - phase_aware {interval({**r._asdict(), 'equal': equal.get(r.setting)})}"
        for r in kv.itertuples())})
    c3 = both_settings(results, "phase_aware", "keydiff")
    out.append({"claim": "C3", "verdict": "replicated" if all(d["low"] > 0 for d in c3.values()) else "not replicated",
                "evidence": "; ".join(f"{s}: phase_aware - keydiff {interval(d)}" for s, d in c3.items())})
    d, g = label(D), label(G)
    answered = set(records.press)
    if {d, g, "kvzip_plus"} <= answered:
        c4 = both_settings(results, d, "phase_aware")
        cells = records[records.compression_ratio > 0].set_index(CELL + ["press"])["mean"].unstack("press")
        g_ok = (cells[g] >= cells["kvzip_plus"] - 0.03 - 1e-9)
        out.append({"claim": "C4", "verdict": "replicated" if all(x["low"] > 0 for x in c4.values())
                    else "not replicated",
                    "evidence": "; ".join(f"{s}: D - phase_aware {interval(x)}" for s, x in c4.items()) +
                    f"; G within 0.03 of KVzip+ in {int(g_ok.sum())} of {len(g_ok)} cells "
                    f"({'met' if g_ok.mean() >= 0.8 else 'missed'}, target 80%)"})
    else:  # runs without the learned designs (the first model's earlier splits, read by the same rules)
        out.append({"claim": "C4", "verdict": NOT_RUN, "evidence": f"no answers of {D}, {G} or kvzip_plus"})
    if results.setting.nunique() < 2:
        mark_incomplete(out[1:], "one setting answered")
    for name in [x for x in ("chunked_stride", "phase_aware", d, g) if x in answered]:
        fam = family(records, records.press == name)
        out.append({"claim": f"T1 {name}", "verdict": "flat" if not (fam.p_holm < ALPHA).any() else "phase effect",
                    "evidence": f"smallest Holm p {fmt_p(fam.p_holm.min() if len(fam) else None)} over {len(fam)} "
                                "cells"})
    return out


def profiles_figure(results: pd.DataFrame, path: str, press: str = "chunked_stride",
                    shown: Optional[pd.DataFrame] = None) -> None:
    """``press``'s accuracy by phase, one panel per ratio (rows) and stride (columns) at ratios up to 0.5 (B1's
    cells; only the strides and ratios of ``shown`` where given), one line per model and setting, pooled over the
    tasks, with a 95% Wilson band (answers score 0 or 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from scipy.stats import binomtest

    part = results[(results.press == press) & (results.compression_ratio > 0) &
                   (results.compression_ratio <= 0.5 + 1e-9)]
    if shown is not None:
        part = part[part.stride.isin(shown.stride.unique()) & part.compression_ratio.isin(shown.compression_ratio.unique())]
    if part.empty:
        raise ValueError(f"no answers of {press!r} at ratios 0.25-0.5 to plot")
    strides, ratios = sorted(part.stride.unique()), sorted(part.compression_ratio.unique())
    fig, axes = plt.subplots(len(ratios), len(strides), figsize=(4.4 * len(strides), 3.0 * len(ratios) + 0.9),
                             squeeze=False, sharey=True)
    lines = part.groupby(["model", "setting", "stride", "compression_ratio", "phase"])["score"].agg(["sum", "count"])
    colours, styles = {}, {"query_agnostic": "-"}
    for (model, setting), rows in lines.groupby(level=["model", "setting"]):
        colour = colours.setdefault(model, f"C{len(colours)}")
        for (stride, ratio), cell in rows.groupby(level=["stride", "compression_ratio"]):
            ax = axes[ratios.index(ratio)][strides.index(stride)]
            phases = cell.index.get_level_values("phase")
            k, n = np.rint(cell["sum"]).astype(int), cell["count"].astype(int)
            band = np.array([binomtest(int(a), int(b)).proportion_ci(method="wilson") for a, b in zip(k, n)])
            ax.plot(phases, cell["sum"] / n, marker=".", color=colour, linestyle=styles.get(setting, "--"),
                    label=f"{model}, {setting.replace('_', '-')}")
            ax.fill_between(phases, band[:, 0], band[:, 1], color=colour, alpha=0.08)
            ax.set_title(f"stride {stride}, ratio {ratio:g}", fontsize=9)
            ax.set_ylim(-0.05, 1.05)
            ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in axes[-1]:
        ax.set_xlabel("phase of the answer's first token")
    for row in axes:
        row[0].set_ylabel("accuracy (both tasks)")
    legend = {}
    for ax in axes.flat:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(name, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(f"{press} by phase on each model (offset protocol, 1,024 tokens; bands: 95% Wilson)", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(rows: list[dict]) -> str:
    lines = ["| claim | verdict | evidence |", "|---|---|---|"]
    lines += [f"| {r['claim']} | {r['verdict']} | {r['evidence']} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--main", nargs="*", default=[], help="runs 1-2 (claims B and C)")
    parser.add_argument("--audit", nargs="*", default=[], help="run 3's directories (claims A)")
    parser.add_argument("--baselines", default=ALL_BASELINES,
                        help="the kvpress baselines a cell's best baseline is chosen among: 'all' (default: every "
                        "registered kvpress baseline) or a comma-separated list of them to restrict it")
    parser.add_argument("--output", help="write the Markdown here as well as to stdout")
    parser.add_argument("--figure", help="draw chunked_stride's accuracy by phase on these runs (and --reference's) here")
    parser.add_argument("--reference", nargs="*", default=[],
                        help="the first model's runs at the same strides (R1's), drawn beside --main in --figure")
    args = parser.parse_args(argv)
    if not args.main and not args.audit:
        print("replication: error: give --main and/or --audit run directories", file=sys.stderr)
        return 2
    try:
        baselines = baseline_labels(args.baselines)
    except ValueError as exc:
        print(f"replication: error: {exc}", file=sys.stderr)
        return 2
    rows = []
    try:
        audit = with_floor(pd.DataFrame(summarize(load(args.audit), n_resamples=200))) if args.audit else None
        rows += audit_claims(audit)
        if args.main:
            results = load(args.main)
            records = pd.DataFrame(summarize(results, n_resamples=200))
            rows += mark_incomplete(r1_claims(records, baselines) + comparison_claims(records, results, baselines),
                                    unfinished(records[records.compression_ratio > 0]))
        else:
            rows += [{"claim": c, "verdict": NOT_RUN, "evidence": ""} for c in ("B1", "B2", "B3", "C1", "C2", "C3", "C4")]
        if args.figure:
            if not args.main:
                raise ValueError("--figure draws --main's runs: give them")
            both = pd.concat([load(args.reference), results]) if args.reference else results
            profiles_figure(both, args.figure, shown=results)
    except (ValueError, KeyError) as exc:
        print(f"replication: error: {exc}", file=sys.stderr)
        return 2
    text = markdown(rows)
    emit(text, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
