"""The ``kvpress-phase train`` command: its flags, the run they describe, and its exit codes. The
``kvpress-phase`` command (:mod:`kvpress_phase.cli`) adds it with :func:`add_command` and runs it with
:func:`run_command`."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import MISSING, fields
from typing import Optional, Sequence

from kvpress_phase.evaluation.arguments import UsageError, csv_list, first_line, threads

from .config import DEFAULT_TASKS, DTYPES, OFFSET_MODES, RECIPES, FinetuneConfig, check_run_settings

DESCRIPTION = """\
Fine-tune a causal LM with ChunkedStridePress or PhaseAwarePress in the loop: each training context is
prefilled under the press, and the model learns to answer from the compressed cache. The press's ratio,
stride and grid offset are drawn for every micro-batch. Checkpoints make a run resumable."""
EXAMPLES = """\
examples:
  kvpress-phase train --recipe chunked --output-dir outputs/models/chunked
  kvpress-phase train --model path/or/hub-id --press chunked_stride --ratios 0.5 --strides 8 --steps 500 \\
      --output-dir outputs/models/my-model

With --max-minutes a run checkpoints and exits with code 3 when the time is up; rerun the same command
to resume. Bad input exits with code 2 and a one-line message."""
"""The help text of ``kvpress-phase train`` (see :func:`add_command`)."""


def _weights(text: str) -> dict:
    """``niah_single:2,niah_multikey`` -> ``{"niah_single": 2.0, "niah_multikey": 1.0}``."""
    out = {}
    for item in text.split(","):
        if not item.strip():
            continue
        name, sep, weight = item.strip().partition(":")
        try:
            out[name] = float(weight) if sep else 1.0
        except ValueError:
            raise argparse.ArgumentTypeError(f"--tasks takes name[:weight],..., got {item!r}") from None
    return out


def _range(text: str) -> list:
    try:
        low, high = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ratio-range takes LOW:HIGH, got {text!r}") from None
    return [low, high]


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvpress-phase train``. Configuration flags default to nothing, so that ``--recipe`` fills
    what the command line leaves out (see :func:`config_from_args`)."""
    S = argparse.SUPPRESS
    # the defaults of the configuration's fields, read without building one (that validates the press, which imports
    # kvpress and torch: building the parser and --help stay fast)
    d = argparse.Namespace(**{f.name: f.default if f.default is not MISSING else f.default_factory()
                              for f in fields(FinetuneConfig)})
    parser.add_argument("--recipe", choices=sorted(RECIPES), default=S,
                        help="start from a named configuration; explicit flags override it")
    parser.add_argument("--model", default=S, help="model name (builtin, chunked, smollm2 or qwen2.5-coder-0.5b: real "
                                                   "models, fetched on first use), local directory or hub id "
                                                   "(default: the built-in model)")
    parser.add_argument("--press", default=S, help=f"chunked_stride or phase_aware, optionally with :key=value "
                                                   f"settings (default: {d.press})")
    parser.add_argument("--ratios", type=csv_list(float, "--ratios"), default=S,
                        help="compression ratios drawn per micro-batch (default: 0.5)")
    parser.add_argument("--ratio-range", type=_range, default=S,
                        help="LOW:HIGH, draw the ratio uniformly in the range instead of from --ratios")
    parser.add_argument("--strides", type=csv_list(int, "--strides"), default=S, help="strides drawn (default: 8)")
    parser.add_argument("--offset-mode", choices=OFFSET_MODES, default=S,
                        help="grid offset: fixed (--offset) or random in [0, stride) per micro-batch (default: random)")
    parser.add_argument("--offset", type=int, default=S, help="offset of --offset-mode fixed (default: 0)")
    parser.add_argument("--curriculum-steps", type=int, default=S,
                        help="grow the largest ratio drawn from the smallest to the largest over that many steps")
    parser.add_argument("--uncompressed-fraction", type=float, default=S,
                        help="share of micro-batches trained without compression (default: 0)")
    parser.add_argument("--tasks", type=_weights, default=S,
                        help="task[:weight],... of the generated data (default: "
                             + ",".join(DEFAULT_TASKS) + "; an empty string for none)")
    parser.add_argument("--dataset", default=S, help="a dataset in kvpress's schema (save_to_disk folder or "
                                                     ".json/.jsonl/.parquet/.csv file)")
    parser.add_argument("--dataset-split", default=S, help="split of --dataset (default: test)")
    parser.add_argument("--dataset-weight", type=float, default=S,
                        help="weight of the dataset's rows beside the task weights (default: 1)")
    parser.add_argument("--context-lengths", type=csv_list(int, "--context-lengths"), default=S,
                        help="context lengths of the generated examples (default: 512,1024)")
    for name, help_text in [("steps", "optimizer steps"), ("batch-size", "examples per micro-batch"),
                            ("grad-accum", "micro-batches per optimizer step"), ("warmup", "warm-up steps"),
                            ("seed", "seed of data, presses and LoRA initialisation"),
                            ("lora-r", "LoRA rank")]:
        parser.add_argument("--" + name, type=int, default=S,
                            help=f"{help_text} (default: {getattr(d, name.replace('-', '_'))})")
    for name, help_text in [("lr", "peak learning rate"), ("min-lr", "final learning rate"),
                            ("weight-decay", "AdamW weight decay on matrices"), ("clip", "gradient-norm clip"),
                            ("lora-alpha", "LoRA alpha"), ("lora-dropout", "LoRA dropout")]:
        parser.add_argument("--" + name, type=float, default=S,
                            help=f"{help_text} (default: {getattr(d, name.replace('-', '_'))})")
    parser.add_argument("--lora", type=_bool, nargs="?", const=True, default=S,
                        help="train LoRA adapters through peft instead of every weight")
    parser.add_argument("--lora-targets", type=csv_list(str, "--lora-targets"), default=S,
                        help="linear layers that get adapters (default: q_proj,k_proj,v_proj,o_proj)")
    parser.add_argument("--dtype", choices=DTYPES, default=S,
                        help="auto: bfloat16 autocast on CUDA, float32 on the CPU (default: auto)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    parser.add_argument("--output-dir", required=True, help="where the fine-tuned model is exported")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="resumable checkpoints (default: checkpoints/<name of --output-dir>)")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (default: 100)")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="checkpoint and stop after training that long in this call (exit code 3); rerun the "
                             "same command to resume")
    parser.add_argument("--threads", type=threads, default=None, metavar="N",
                        help="torch's intra-op CPU threads (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def add_command(sub) -> argparse.ArgumentParser:
    """Add ``train`` to ``sub``, the subparsers of a ``kvpress-phase`` parser; the ``train`` parser."""
    parser = sub.add_parser("train", help="fine-tune a model with a press in the loop", description=DESCRIPTION,
                            epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    """The configuration of parsed ``train`` flags: the recipe's values, overridden by the flags given."""
    values = dict(RECIPES[args.recipe]) if getattr(args, "recipe", None) else {}
    for f in fields(FinetuneConfig):
        if hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    return FinetuneConfig(**values)


def run_from_args(args: argparse.Namespace, command: Optional[str] = None) -> dict:
    """Run ``kvpress-phase train`` from parsed flags (ValueError for a bad configuration). The checks of
    ``--checkpoint-every`` and ``--max-minutes`` come first, then the configuration's: the torch-free ones of both
    run before anything imports torch, kvpress or transformers, and so does the check of ``--model``
    (:func:`kvpress_phase.builtin.check_model_name`: an unknown name is refused at once, naming the registered ones)."""
    from kvpress_phase.builtin import check_model_name

    check_run_settings(args.checkpoint_every, args.max_minutes)
    check_model_name(getattr(args, "model", None))  # a recipe's model is a registered name
    config = config_from_args(args)  # builds the press: imports torch and kvpress
    from .finetune import finetune

    output_dir = args.output_dir
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--output-dir {output_dir!r} cannot be created: {exc.strerror}") from None
    return finetune(config, output_dir, args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                    progress=not args.no_progress, device=args.device, threads=args.threads, command=command,
                    max_minutes=args.max_minutes)


def run_command(args: argparse.Namespace, argv: Optional[Sequence[str]] = None) -> int:
    """Run ``kvpress-phase train`` from parsed flags, recording the command line ``argv`` (None: ``sys.argv[1:]``)
    in the training log: 0 when trained, 3 when ``--max-minutes`` paused it (rerun the same command to resume);
    a bad configuration is a :class:`~kvpress_phase.evaluation.arguments.UsageError`."""
    command = "kvpress-phase " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        log = run_from_args(args, command=command)
    except ValueError as exc:
        raise UsageError(first_line(exc)) from None
    if log["steps_done"] < log["config"]["steps"]:
        print(f"paused at step {log['steps_done']} of {log['config']['steps']}; rerun the same command to resume")
        return 3
    print(f"model: {args.output_dir}")
    return 0


__all__ = ["add_arguments", "add_command", "config_from_args", "run_command", "run_from_args"]
