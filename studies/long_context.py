"""R11, the phase effect at 4k-16k tokens on Qwen2.5-Coder-0.5B (docs/preregistration-long-context.md): its runs,
resumable on any machine, committed to git as they go, with a line that says how far they are.

    python -m studies.long_context run                 # every pre-registered length in turn, resuming each
    python -m studies.long_context run --lengths 4096  # one length
    python -m studies.long_context status              # answers held and left, and the time left, per length
    python -m studies.long_context command 8192        # the eval command of one length (to run it by hand)
    python -m studies.long_context paper               # on paper: the study's GPU memory and time at 32k and 128k
    python -m studies.long_context tables              # the pre-registered tables and the figure, from the runs so far

``run`` starts ``kvpress-phase eval`` for each length into ``outputs/long-context/n<LENGTH>`` (it resumes a run
where its answers stop: an answer is written once, under its key), commits that folder every ``--commit-every``
seconds (default 1800) and when the length ends, then packs the finished run and commits it. Stopped (Ctrl-C, a
session's end), it stops the evaluation, commits what the folder holds and exits; the next ``run``, on this machine
or a fresh clone, resumes. Each commit appends a line to the folder's ``progress.jsonl`` (time, answers held), from
which ``status`` reads the rate of the latest stretch of work. The run refuses to start unless the
pre-registration is committed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Optional

from studies import resumable

PREREGISTRATION = "docs/preregistration-long-context.md"
OUTPUT = "outputs/long-context"
LENGTHS = (4096, 8192, 16384)
"""The lengths R11 may run, in this order; which of them it reports is the pre-registration's rule."""
PRESSES = ("no_press", "chunked_stride", "chunked_stride:mode=pool", "phase_aware", "global_budget:scorer=kvzap",
           "kvzip_plus", "keydiff", "snapkv", "adakv")
"""The pre-registered presses: ours, the recommended press, and the strongest baselines of the last split."""
EVAL_FLAGS = ("--model", "qwen2.5-coder-0.5b", "--tasks", "niah_single,niah_multikey", "--strides", "4,8",
              "--windows", "8", "--compression-ratios", "0.5,0.75", "--protocol", "offset", "--matched-cache",
              "--samples", "8", "--seed", "91", "--no-diagnostics", "--threads", "2", "--dtype", "float32")
SECONDS_PER_TEXT = {4096: 210.0, 8192: 470.0, 16384: 1270.0}
"""One text's cost (a prefill, KVzip+'s scoring and every press's replay and decoding) on the 2-core machine: at
4,096 tokens the study's own pace (3,264 answers of 16 texts in 56 minutes, ``outputs/long-context/n4096``), above
it scaled by the prefill's growth (x2.24 and x6.04, docs/results/long-context/sizing.md). ``status`` uses it only
where a length has no timed stretch of its own yet."""
TEXTS = 16
"""Texts per length: 8 samples per phase of 2 tasks under the offset protocol (a text is placed at every phase)."""


def run_dir(length: int) -> str:
    return os.path.join(OUTPUT, f"n{length}")


def eval_command(length: int) -> list[str]:
    return ["kvpress-phase", "eval", *EVAL_FLAGS, "--presses", ",".join(PRESSES), "--context-lengths", str(length),
            "--output-dir", run_dir(length)]


# ------------------------------------------------------------------------------------------------ progress
def planned(length: int) -> int:
    return resumable.planned(eval_command(length))


def held(length: int) -> int:
    return resumable.held(run_dir(length))


def progress(length: int, plan: Optional[int] = None) -> resumable.Progress:
    return resumable.progress(run_dir(length), plan if plan is not None else planned(length), name=f"n{length}",
                              estimate=SECONDS_PER_TEXT[length] * TEXTS)


def run_length(length: int, commit_every: float, do_commit: bool) -> bool:
    """Run (or resume) one length to its end; False when it was stopped or failed."""
    return resumable.run_committed(eval_command(length), run_dir(length), planned(length),
                                   title=f"Long-context study (R11), {length:,} tokens", commit_every=commit_every,
                                   do_commit=do_commit, estimate=SECONDS_PER_TEXT[length] * TEXTS)


# ------------------------------------------------------------------------------------------------ on paper
@dataclasses.dataclass(frozen=True)
class Shape:
    """What the estimate needs of a model: its parameter count and the shapes of its layers."""

    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    window: int  # the positions it was trained on

    @property
    def layer_params(self) -> float:  # q, k, v, o and the gated MLP of one layer
        return (2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
                + 3 * self.hidden * self.intermediate)

    def prefill_flops(self, n: int) -> float:
        """Matrix products of one causal prefill of ``n`` tokens: 2 per parameter and token, and QK^T and AV over
        half the n^2 pairs on average."""
        return self.layers * (2 * n * self.layer_params + 2 * n * n * self.heads * self.head_dim)


QWEN = Shape("Qwen2.5-Coder-0.5B", 630e6, 24, 896, 14, 2, 64, 4864, 32768)
LLAMA_8B = Shape("Llama-3.1-8B", 8.03e9, 32, 4096, 32, 8, 128, 14336, 131072)
H200_FLOPS = 5.7e14
"""FLOP/s of the H200's measured prefills of Llama-3.1-8B's layer shapes (bfloat16, sdpa; 79.6 ms at 32k and 704 ms
at 128k for 2 layers, docs/results/gpu-h200-2026-12-04/gpu_extra.json): the rate a prefill reaches there."""
KVZIP_PLUS_X = 6.6
"""KVzip+'s prefill with its scoring over the prefill alone, on the same H200 (6.5-6.8 from 8k to 128k)."""
GPU_ANSWERS_PER_S_BUILTIN = 83.9
"""The H200's rate over the default job on the built-in 4-layer model (docs/results/gpu-h200-2026-12-04): replays
and decoding there are bound by kernel launches, so a model of L layers answers about 4 / L times as fast."""


def on_paper(shape: Shape, n: int, dtype_bytes: int = 2, ratio_kept: float = 0.5, decode_batch: int = 16,
             offload: bool = False, texts: int = TEXTS, answers: int = 3264) -> dict:
    """One length of the study on one GPU: the memory the evaluation holds at its peak and the hours it takes.
    ``offload``: ``--offload cpu``, the recorded prefill in the host's memory (the prefill then holds one layer's
    keys and values at a time)."""
    gib = 1024 ** 3
    kv = shape.layers * 2 * shape.kv_heads * shape.head_dim * dtype_bytes  # bytes per token of the cache
    weights = shape.params * dtype_bytes
    recorded = n * (kv + shape.layers * shape.hidden * dtype_bytes)  # every layer's keys, values and hidden states
    transient = n * 3 * shape.intermediate * dtype_bytes  # one layer's MLP (gate, up, their product)
    decoding = decode_batch * ratio_kept * n * kv  # 16 caches at ratio 0.5 decoded together
    prefill = shape.prefill_flops(n) / H200_FLOPS
    per_text = prefill * KVZIP_PLUS_X
    replay = answers / (GPU_ANSWERS_PER_S_BUILTIN * 4 / shape.layers)
    return {"model": shape.name, "tokens": n, "past its window": n > shape.window,
            "cache GiB": n * kv / gib, "weights GiB": weights / gib, "recorded prefill GiB": recorded / gib,
            "prefill transient GiB": transient / gib, "decoding GiB": decoding / gib,
            "peak GiB": (weights + (max(transient + n * kv / shape.layers, decoding) if offload
                                    else recorded + max(transient, decoding))) / gib,
            "host GiB": recorded / gib if offload else 0.0, "decode batch": decode_batch,
            "prefill s": prefill, "prefill + KVzip+ s": per_text, "replays and decoding s": replay,
            "hours": (texts * per_text + replay) / 3600}


def paper_table() -> str:
    rows = [on_paper(QWEN, 4096, 4), on_paper(QWEN, 30720), on_paper(QWEN, 131072),
            on_paper(LLAMA_8B, 131072, decode_batch=2, offload=True)]
    header = ["model", "tokens", "dtype", "cache", "weights", "recorded prefill", "decoding (caches at once)",
              "peak", "prefill", "prefill + KVzip+", "replays + decoding", "study"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r, dtype in zip(rows, ["float32", "bfloat16", "bfloat16", "bfloat16"]):
        past = " (past its window)" if r["past its window"] else ""
        lines.append(f"| {r['model']}{past} | {r['tokens']:,} | {dtype} | {r['cache GiB']:.2f} GiB | "
                     f"{r['weights GiB']:.2f} GiB | {r['recorded prefill GiB']:.2f} GiB"
                     + (" (host, `--offload cpu`)" if r["host GiB"] else "")
                     + f" | {r['decoding GiB']:.2f} GiB ({r['decode batch']}) | "
                     f"**{r['peak GiB']:.1f} GiB** | {r['prefill s']:.2f} s | {r['prefill + KVzip+ s']:.1f} s | "
                     f"{r['replays and decoding s']:.0f} s | **{r['hours'] * 60:.0f} min** |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the tables
WINDOWED = ("chunked_stride", "chunked_stride:mode=pool")
"""The presses with fixed windows, where the phase test speaks (L1, L2)."""
RECOMMENDED = "global_budget:scorer=kvzap"
BASELINES = ("kvzip_plus", "keydiff", "snapkv", "adakv")
NEAR = 0.03
FLOOR = 0.25


def load_study(runs: Optional[list] = None):
    """Every answer of the study's runs (or of ``runs``), with a ``grid`` column: ``W=8, S=4`` and so on (empty for
    a press without a grid)."""
    import pandas as pd

    from kvpress_phase.evaluation.store import read_results

    runs = runs if runs is not None else [run_dir(n) for n in LENGTHS if os.path.isdir(run_dir(n))]
    frames = [read_results(r) for r in runs]
    frames = [f for f in frames if len(f)]
    if not frames:
        raise SystemExit("long_context: no answers yet in " + ", ".join(runs or [OUTPUT]))
    df = pd.concat(frames, ignore_index=True)
    window = df["window"].astype(float)
    df["grid"] = [f"W={int(w)}, S={s}" if w == w else "" for w, s in zip(window, df["stride"])]
    return df


def _matrix(block):
    """Texts (task, sample) x phases, the texts that answered every phase."""
    return block.pivot_table(index=["task", "sample_id"], columns="phase", values="score", aggfunc="mean").dropna()


def phase_table(df, presses: tuple, by_task: bool = False) -> "pd.DataFrame":
    """Per length, press, grid and ratio (and task, ``by_task``: the cells): the within-text permutation test over
    the texts of both tasks, pooled (Holm over the rows of a length), the share of texts whose answer moves with the
    phase, the cross-fitted gap with its 95% CI, and the mean."""
    import numpy as np
    import pandas as pd

    from kvpress_phase.evaluation.metrics import crossfit_gap, holm, permutation_p_value

    part = df[df.press.isin(presses) & (df.compression_ratio > 0)]
    rows = []
    keys = ["context_length", "press", "grid", "compression_ratio"] + (["task"] if by_task else [])
    for key, block in part.groupby(keys):
        n, press, grid, ratio = key[:4]
        m = _matrix(block).to_numpy()
        gap = crossfit_gap(m, rng=np.random.default_rng(0)) if len(m) else (None, None, None)
        rows.append({"tokens": n, "press": press, "grid": grid, "ratio": ratio,
                     **({"task": key[4]} if by_task else {}), "texts": len(m),
                     "mean": block.score.mean(), "moves": float((m.max(axis=1) > m.min(axis=1)).mean()) if len(m) else np.nan,
                     "p": permutation_p_value(m, rng=np.random.default_rng(0)) if len(m) else np.nan,
                     "gap": gap[0], "gap_low": gap[1], "gap_high": gap[2]})
    table = pd.DataFrame(rows)
    if len(table):
        table["p_holm"] = table.groupby("tokens")["p"].transform(lambda p: holm(p.fillna(1.0).to_numpy()))
    return table


def l1_verdicts(table) -> dict:
    """L1 per length: present, not detected or undetectable (the pre-registration's rule)."""
    out = {}
    for n, rows in table.groupby("tokens"):
        off_floor = int((rows["mean"] >= FLOOR).sum())
        out[n] = ("present" if (rows.p_holm < 0.05).any()
                  else "not detected" if off_floor >= 2 else "undetectable at this sample size")
    return out


def growth_table(table) -> "pd.DataFrame":
    """L2: the share of texts whose answer moves with the phase, at the shortest and the longest length run, per
    press, grid and ratio; one-sided Fisher exact (longer > shorter), Holm over the rows."""
    import pandas as pd
    from scipy.stats import fisher_exact

    from kvpress_phase.evaluation.metrics import holm

    lengths = sorted(table.tokens.unique())
    if len(lengths) < 2:
        return pd.DataFrame()
    short, long = lengths[0], lengths[-1]
    rows = []
    for (press, grid, ratio), rs in table.groupby(["press", "grid", "ratio"]):
        a, b = rs[rs.tokens == short].iloc[0], rs[rs.tokens == long].iloc[0]
        ka, kb = round(a.moves * a.texts), round(b.moves * b.texts)
        p = fisher_exact([[kb, b.texts - kb], [ka, a.texts - ka]], alternative="greater")[1]
        rows.append({"press": press, "grid": grid, "ratio": ratio, "short": short, "long": long,
                     "moves_short": a.moves, "moves_long": b.moves, "mean_short": a["mean"], "mean_long": b["mean"],
                     "p": p})
    out = pd.DataFrame(rows)
    out["p_holm"] = holm(out.p.to_numpy())
    return out


def level_tables(df):
    """L4 on the S = 8 grid (the baselines have none): per cell (length, task, ratio) the recommended press's mean
    and the best baseline's, whether it is within 0.03, and the yardstick; and the paired differences by text,
    pooled over tasks, per length and ratio."""
    import numpy as np
    import pandas as pd
    from scipy import stats

    from kvpress_phase.evaluation.metrics import tied_share

    part = df[(df.stride == 8) & (df.compression_ratio > 0) & df.press.isin((RECOMMENDED,) + BASELINES)]
    cell = ["context_length", "task", "compression_ratio"]
    means = part.groupby(cell + ["press"])["score"].mean().unstack("press")
    answered = [b for b in BASELINES if b in means]
    means["best"] = means[answered].max(axis=1)
    means["best_by"] = means[answered].idxmax(axis=1)
    means["within"] = means[RECOMMENDED] >= means["best"] - NEAR - 1e-9
    means["all_answer"] = (means[[RECOMMENDED] + answered] >= 1.0).all(axis=1)
    try:
        yardstick = tied_share(part[part.press.isin(answered)], cell=cell, baselines=answered, replicates=2000)
    except ValueError:  # a design the copula cannot be fitted on (e.g. one text): no yardstick
        yardstick = None
    per_text = part.groupby(["context_length", "compression_ratio", "task", "sample_id", "press"])["score"].mean()
    per_text = per_text.unstack("press")
    rows = []
    for (n, ratio), block in per_text.groupby(level=["context_length", "compression_ratio"]):
        for b in answered:
            d = (block[RECOMMENDED] - block[b]).dropna()
            k = len(d)
            half = stats.t.ppf(0.975, k - 1) * d.std(ddof=1) / np.sqrt(k) if k > 1 else np.nan
            rows.append({"tokens": n, "ratio": ratio, "against": b, "texts": k, "diff": d.mean(),
                         "low": d.mean() - half, "high": d.mean() + half})
    return means.reset_index(), yardstick, pd.DataFrame(rows)


def _f(x, digits=2) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def _p(x) -> str:
    return "-" if x != x else ("<0.001" if x < 0.001 else f"{x:.3f}")


def _phase_rows(table, fifth: str) -> list[str]:
    """A phase table (:func:`phase_table`) as markdown, its fifth column ``texts`` (pooled) or ``task`` (cells)."""
    rows = [f"| tokens | press | grid | ratio | {fifth} | mean | moves | p | Holm p | cross-fitted gap (95% CI) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    return rows + [f"| {r.tokens:,} | `{r.press}` | {r.grid} | {r.ratio:g} | {r[fifth]} | {r['mean']:.3f} | "
                   f"{_f(r.moves)} | {_p(r.p)} | {_p(r.p_holm)} | {_f(r.gap)} ({_f(r.gap_low)} to {_f(r.gap_high)}) |"
                   for _, r in table.iterrows()]


def tables_markdown(df, held: Optional[dict] = None) -> str:
    lines = []
    if held:
        lines += ["Answers held per length: " + "; ".join(f"{n:,} tokens {h:,} of {t:,}" for n, (h, t) in held.items())
                  + ". A length not complete is interim: its tables change as answers come.", ""]
    acc = df[df.compression_ratio >= 0].groupby(["context_length", "press", "grid", "compression_ratio"])["score"]
    acc = acc.agg(["mean", "count"]).reset_index()
    lines += ["### Accuracy by press (both tasks, every phase)", "",
              "| tokens | press | grid | ratio | mean | answers |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.context_length:,} | `{r.press}` | {r.grid or '-'} | {r.compression_ratio:g} | {r['mean']:.3f} | "
              f"{r['count']} |" for _, r in acc.iterrows()]
    phase = phase_table(df, WINDOWED)
    verdicts = l1_verdicts(phase) if len(phase) else {}
    lines += ["", "### L1: the phase effect at each length (windowed presses; pooled over both tasks' texts)", "",
              "Holm over the rows of a length. `moves`: the share of texts whose answer differs between two phases. "
              "Detectable: one phase 0.55 below the others at S = 8 (0.50 at S = 4) with 80% power.", "",
              *_phase_rows(phase, "texts")]
    partial = {n: ht for n, ht in (held or {}).items() if ht[0] < ht[1]}  # lengths not complete, with (held, total)
    lines += [""] + [f"- L1 at {n:,} tokens: **{v}**"
                     + (f" (interim: {partial[n][0]:,} of {partial[n][1]:,} answers)." if n in partial else ".")
                     for n, v in verdicts.items()]
    cells = phase_table(df, WINDOWED, by_task=True)
    lines += ["", "Per cell (one task; 8 texts; Holm over the cells of a length; detectable: one phase 0.75 below the "
              "others), a description of where an effect lies:", "",
              *_phase_rows(cells, "task")]
    growth = growth_table(phase) if len(phase) else None
    lines += ["", "### L2: growth with length", ""]
    if growth is None or not len(growth):
        lines += ["One length so far: growth is read when a second length has answers."]
    else:
        lines += ["One-sided Fisher exact (the longer length moves more), Holm over the rows; 80% power for a rise of "
                  "about 0.5 in the share.", "",
                  "| press | grid | ratio | moves (short) | moves (long) | mean (short) | mean (long) | p | Holm p |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| `{r.press}` | {r.grid} | {r.ratio:g} | {r.moves_short:.2f} ({r.short:,}) | {r.moves_long:.2f} "
                  f"({r.long:,}) | {r.mean_short:.3f} | {r.mean_long:.3f} | {_p(r.p)} | {_p(r.p_holm)} |"
                  for _, r in growth.iterrows()]
        lines += ["", f"- L2: **{'grows' if (growth.p_holm < 0.05).any() else 'no growth detected'}**."]
        longest = int(growth.long.iloc[0])
        pending = [n for n in partial if n >= longest]
        if pending:
            lines += [f"- Interim: the pre-registered reading compares the shortest length with the longest, and "
                      f"{', '.join(f'{n:,}' for n in pending)} tokens {'is' if len(pending) == 1 else 'are'} not "
                      f"complete; this compares {int(growth.short.iloc[0]):,} with {longest:,}."]
    flat = phase_table(df, (RECOMMENDED,))
    lines += ["", f"### L3: the recommended press `{RECOMMENDED}` is flat", "",
              "Holm over every row. The test speaks only where answers move with the phase (`moves` > 0).", "",
              "| tokens | grid | ratio | texts | mean | moves | p | Holm p |", "|---|---|---|---|---|---|---|---|"]
    if len(flat):
        from kvpress_phase.evaluation.metrics import holm

        flat["p_all"] = holm(flat.p.fillna(1.0).to_numpy())
        lines += [f"| {r.tokens:,} | {r.grid} | {r.ratio:g} | {r.texts} | {r['mean']:.3f} | {_f(r.moves)} | {_p(r.p)} | "
                  f"{_p(r.p_all)} |" for _, r in flat.iterrows()]
        verdict = "not flat" if (flat.p_all < 0.05).any() else "flat"
        lines += ["", f"- L3: **{verdict}** ({'a phase effect' if verdict == 'not flat' else 'no phase effect'} "
                  f"detected; its answers move with the phase on {flat.moves.mean():.0%} of texts)."]
    means, yardstick, paired = level_tables(df)
    lines += ["", f"### L4: `{RECOMMENDED}` against the best of {', '.join(f'`{b}`' for b in BASELINES)} (S = 8)", "",
              "| tokens | task | ratio | recommended | best baseline | best | within 0.03 | every press answers all |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r.context_length:,} | {r.task} | {r.compression_ratio:g} | {r[RECOMMENDED]:.3f} | `{r.best_by}` | "
              f"{r.best:.3f} | {'yes' if r.within else 'no'} | {'yes' if r.all_answer else 'no'} |"
              for _, r in means.iterrows()]
    share = means.within.mean()
    yard = (f"a press tied with the best would be counted in {yardstick.expected:.0%} of these cells "
            f"(90% of simulated splits {yardstick.low:.0%}-{yardstick.high:.0%}; an upper estimate)"
            if yardstick is not None else "the yardstick cannot be fitted on these answers")
    lines += ["", f"Within 0.03 in {int(means.within.sum())} of {len(means)} cells ({share:.0%}); {yard}. "
              f"{int(means.all_answer.sum())} cells have every one of these presses answer every needle: they cannot "
              "tell the presses apart.", "",
              "Paired differences (recommended minus baseline) by text, both tasks, 95% t interval:", "",
              "| tokens | ratio | against | texts | difference | 95% CI |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.tokens:,} | {r.ratio:g} | `{r.against}` | {r.texts} | {r['diff']:+.3f} | {_f(r.low, 3)} to "
              f"{_f(r.high, 3)} |" for _, r in paired.iterrows()]
    trails = paired[paired.high < -NEAR]
    level = paired[paired.low > -NEAR]
    lines += ["", f"- L4: level (interval above -0.03) in {len(level)} of {len(paired)} comparisons; trails (interval "
              f"wholly below -0.03) in {len(trails)}"
              + (": " + ", ".join(f"`{r.against}` at {r.tokens:,} tokens, ratio {r.ratio:g}" for _, r in trails.iterrows())
                 if len(trails) else "") + "."]
    return "\n".join(lines) + "\n"


def figure(df, path: str) -> None:
    """Accuracy by phase: a panel per length (columns) and ratio (rows), a line per press and grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    part = df[df.press.isin(WINDOWED + (RECOMMENDED,)) & (df.compression_ratio > 0)]
    lengths, ratios = sorted(part.context_length.unique()), sorted(part.compression_ratio.unique())
    fig, axes = plt.subplots(len(ratios), len(lengths), figsize=(max(4.2 * len(lengths), 9.0), 3.2 * len(ratios) + 1.2),
                             squeeze=False, sharey=True)
    for i, ratio in enumerate(ratios):
        for j, n in enumerate(lengths):
            ax = axes[i][j]
            cell = part[(part.context_length == n) & (part.compression_ratio == ratio)]
            for (press, grid), block in cell.groupby(["press", "grid"]):
                curve = block.groupby("phase")["score"].mean()
                style = "--" if grid.endswith("S=4") else "-"
                ax.plot(curve.index, curve.values, style, marker="o", ms=3, label=f"{press} ({grid})")
            ax.set_title(f"{n:,} tokens, ratio {ratio:g}", fontsize=9)
            ax.set_xlabel("phase")
            ax.set_ylim(-0.05, 1.05)
            if j == 0:
                ax.set_ylabel("accuracy (both tasks)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle("Qwen2.5-Coder-0.5B: accuracy by phase (dashed: the S = 4 grid)", fontsize=10)
    fig.tight_layout(rect=(0, 0.16, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.long_context", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="run or resume the study's lengths in turn, committing as it goes")
    run.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                     help="comma-separated context lengths, of " + ", ".join(map(str, LENGTHS)))
    resumable.add_run_options(run)
    sub.add_parser("status", help="answers held and left per length, and the time left")
    sub.add_parser("paper", help="on paper: one length's GPU memory and time at 4k (check), 30k and 128k tokens")
    tables = sub.add_parser("tables", help="the pre-registered tables (markdown) and the figure, from the runs so far")
    tables.add_argument("--runs", nargs="*", default=None, help="runs to read (default: the study's)")
    tables.add_argument("--output", default=None, help="write the tables here (default: print them)")
    tables.add_argument("--figure", default=None, help="write the accuracy-by-phase figure here (PNG)")
    command = sub.add_parser("command", help="the eval command of one length")
    command.add_argument("length", type=int)
    args = parser.parse_args(argv)

    if args.what == "command":
        if args.length not in LENGTHS:
            parser.error(f"length must be one of {', '.join(map(str, LENGTHS))}, got {args.length}")
        print(" ".join(eval_command(args.length)))
        return 0
    if args.what == "tables":
        df = load_study(args.runs)
        held_by = None
        if args.runs is None:
            held_by = {n: (held(n), planned(n)) for n in LENGTHS if os.path.isdir(run_dir(n))}
        text = tables_markdown(df, held_by)
        if args.output:
            with open(args.output, "w") as fh:
                fh.write(text)
        else:
            print(text)
        if args.figure:
            figure(df, args.figure)
        return 0
    if args.what == "paper":
        print(paper_table())
        return 0
    if args.what == "status":
        total = 0.0
        for length in LENGTHS:
            p = progress(length)
            total += p.seconds_left
            print(p.line())
        print(f"all lengths: about {resumable.hours(total)} left")
        return 0
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    resumable.start_runs(parser, args, lengths, LENGTHS, PREREGISTRATION)
    for length in lengths:
        if not run_length(length, args.commit_every, not args.no_commit):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
