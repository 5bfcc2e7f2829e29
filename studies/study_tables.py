"""Tables of the phase study in both regimes (RESULTS.md, section 5) from the study's output directories.

    python -m studies.study_tables outputs/study-training

Reads ``<root>/<model>/<block>/`` (``kvpress-phase eval`` output directories; models ``builtin`` and ``chunked``,
blocks C, D, A-1024, A-2048, B1, B2, whichever exist) and prints Markdown: the per-phase profiles with the
calibrated statistics, Holm-adjusted p-values of the primary cells, the accuracy targets of block A, and two
within-sample sign-flip tests of ``chunked_stride``'s phase profile: the pre-registered one (phases whose answer's
first two tokens fall into one pooled group against the other non-boundary phases) and the exploratory one (the
first slot of each pooled group against the other non-boundary phases).
"""
import json
import os
import sys

import numpy as np
import pandas as pd

from kvpress_phase.evaluation.metrics import holm
from kvpress_phase.evaluation.store import read_results
from kvpress_phase.core.phase import group_bounds, kept_per_window

ROOT = "outputs/study-training"
MODELS = ["builtin", "chunked"]


def summary(model, block):
    p = os.path.join(ROOT, model, block, "summary.json")
    if not os.path.exists(p):
        return None
    df = pd.DataFrame(json.load(open(p)))
    df["model"] = model
    return df


def fmt_p(p):
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def gap(r):
    if r["gap_xfit"] is None or (isinstance(r["gap_xfit"], float) and np.isnan(r["gap_xfit"])):
        return "-"
    return f"{r['gap_xfit']:.2f} [{r['gap_xfit_ci_low']:.2f}, {r['gap_xfit_ci_high']:.2f}]"


def copooled(stride, ratio):
    k = kept_per_window(stride, ratio)
    lo, hi = group_bounds(stride, stride, k)
    group = {}
    for g in range(k):
        for s in range(lo[g], hi[g]):
            group[s] = g
    return [i for i in range(stride - 1) if group[i] == group[i + 1]]


def signflip(diff, n=20000, seed=0):
    diff = np.asarray(diff, float)
    obs = diff.mean()
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], size=(n, len(diff)))
    null = (signs * diff).mean(1)
    return obs, (np.sum(np.abs(null) >= abs(obs) - 1e-12) + 1) / (n + 1)


def block_c(block="C"):
    out = ["| model | task | ratio | press | mean | worst (phase) | per phase 0..7 | p | cochran p | cross-fitted gap [95% CI] | detectable |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for m in MODELS:
        df = summary(m, block)
        if df is None:
            continue
        for _, r in df.sort_values(["task", "compression_ratio", "press"]).iterrows():
            pp = " ".join(f"{x:.2f}" for x in r["per_phase"])
            out.append(f"| {m} | {r['task']} | {r['compression_ratio']:g} | {r['press']} | {r['mean']:.3f} | "
                       f"{r['worst']:.2f} ({r['worst_phase']}) | {pp} | {fmt_p(r['p_value'])} | "
                       f"{fmt_p(r['cochran_p']) if r['cochran_p'] is not None and not pd.isna(r['cochran_p']) else '-'} | {gap(r)} | "
                       f"{r['detectable_gap'] if r['detectable_gap'] is not None else '-'} |")
            rows.append(r)
    return "\n".join(out), pd.DataFrame(rows)


def group_starts(stride, ratio):
    """Slots where a pooled group starts (the exploratory account), the boundary slot left out."""
    lo, _ = group_bounds(stride, stride, kept_per_window(stride, ratio))
    return [x for x in lo if x < stride - 1]


def phase_set_test(block, phase_set, label):
    """Per cell of ``chunked_stride``: accuracy at the phases ``phase_set(stride, ratio)`` against the other
    non-boundary phases, with a within-sample sign-flip test of the difference."""
    out = [f"| model | task | ratio | {label} | acc there | acc other non-boundary | difference | sign-flip p |",
           "|---|---|---|---|---|---|---|---|"]
    for m in MODELS:
        d = os.path.join(ROOT, m, block)
        if not os.path.exists(os.path.join(d, "summary.json")):
            continue
        res = read_results(d)
        res = res[res["press"] == "chunked_stride"]
        for (task, ratio), g in res.groupby(["task", "compression_ratio"]):
            S = int(g["stride"].iloc[0])
            chosen = phase_set(S, ratio)
            other = [i for i in range(S - 1) if i not in chosen]
            per = g.pivot_table(index="sample_id", columns="phase", values="score")
            obs, p = signflip((per[chosen].mean(1) - per[other].mean(1)).values)
            out.append(f"| {m} | {task} | {ratio:g} | {','.join(map(str, chosen))} | {per[chosen].values.mean():.3f} | "
                       f"{per[other].values.mean():.3f} | {obs:+.3f} | {fmt_p(p)} |")
    return "\n".join(out)


def block_a(block):
    frames = [summary(m, block) for m in MODELS]
    frames = [f for f in frames if f is not None]
    if not frames:
        return None
    df = pd.concat(frames)
    out = []
    for m, dm in df.groupby("model"):
        ref = dm[dm.press == "no_press"].set_index(["task", "stride"])["mean"]
        presses = ["chunked_stride", "phase_aware", "snapkv", "chunkkv", "streaming_llm", "knorm"]
        out.append(f"\n**{m}**, {block}\n")
        out.append("| task | S | ratio | cache | no_press | chunked_stride (p) | phase_aware (p) | snapkv | chunkkv | streaming_llm | knorm | CS within 0.03 of no_press | CS >= SnapKV |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        comp = dm[dm.press != "no_press"]
        met_a = met_b = n = 0
        for (task, S, ratio), g in comp.groupby(["task", "stride", "compression_ratio"]):
            g = g.set_index("press")
            nref = ref.loc[(task, S)]
            cs = g.loc["chunked_stride"]
            cells = []
            for p in presses:
                if p not in g.index:
                    cells.append("-")
                elif p in ("chunked_stride", "phase_aware"):
                    cells.append(f"{g.loc[p,'mean']:.3f} ({fmt_p(g.loc[p,'p_value'])})")
                else:
                    cells.append(f"{g.loc[p,'mean']:.3f}")
            a = cs["mean"] >= nref - 0.03
            b = cs["mean"] >= g.loc["snapkv", "mean"] if "snapkv" in g.index else False
            n += 1; met_a += a; met_b += b
            out.append(f"| {task} | {S} | {ratio:g} | {cs['cache_length']:.0f} | {nref:.3f} | " + " | ".join(cells)
                       + f" | {'yes' if a else 'no (' + format(cs['mean'] - nref, '+.3f') + ')'} | {'yes' if b else 'no (' + format(cs['mean'] - g.loc['snapkv','mean'], '+.3f') + ')'} |")
        out.append(f"\n{m} {block}: CS within 0.03 of no_press in {met_a}/{n}; CS >= SnapKV in {met_b}/{n}; "
                   f"CS p<0.05 in {(comp[comp.press=='chunked_stride'].p_value < 0.05).sum()}/{n}; "
                   f"PA p<0.05 in {(comp[comp.press=='phase_aware'].p_value < 0.05).sum()}/{n}")
    return "\n".join(out)


def main(argv=None) -> int:
    global ROOT
    argv = sys.argv[1:] if argv is None else argv
    ROOT = argv[0] if argv else ROOT
    t, rows = block_c("C")
    print("## C\n" + t)
    if len(rows):
        cs = rows[(rows.model == "chunked") & (rows.press == "chunked_stride")]
        if len(cs):
            adjusted = holm(cs.p_value)
            print("\nHolm over the trained-in chunked_stride cells: " + ", ".join(
                f"{t} {r:g}: p {p:.4f}, Holm {h:.4f}"
                for t, r, p, h in zip(cs.task, cs.compression_ratio, cs.p_value, adjusted)))
    print("\n## mechanism C\n" + phase_set_test("C", copooled, "co-pooled phases"))
    t, _ = block_c("D")
    print("\n## D\n" + t)
    for b in ["A-1024", "A-2048", "B2", "B1"]:
        r = block_a(b)
        if r:
            print("\n## " + b + r)
    print("\n## group start C\n" + phase_set_test("C", group_starts, "group-start phases"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
