"""The phase evaluation runner: prefill once, replay every compression, decode every distinct cache once.

kvpress compression changes only the cache: the prefill activations are the same whatever the press. So for each
context the runner prefills once with a capturing press that records, for every hooked attention layer, the
arguments kvpress would hand to ``press.compress``. Every press variant (press x compression ratio x window x grid
offset) is then applied to those recorded inputs, the compressed tensors are put into a shallow copy of the
cache, and each question is decoded greedily as kvpress's pipeline decodes it (:mod:`.decoding`: caches of one
shape in one batch, the uncompressed answer checked as a draft). Decoded step by step one cache at a time, the
answers are the ones a ``pipeline("kv-press-text-generation")(context, question=..., press=...)`` call per variant
would give (``tests/evaluation/test_runner.py``); the batched and drafted path gives the same answers up to float
rounding at near-ties (``tests/evaluation/test_batched_decoding.py``, ``tests/models/``).

The prefill records only what the presses under test read (hidden states only for presses that read them, see
:func:`.presses.prefill_reads`), holds one context at a time, and with ``offload="cpu"`` keeps the recorded tensors in
CPU memory (docs/evaluation.md, "Memory of the replay runner", has the peak-memory formula). Variants are decoded once per
distinct compressed cache (:func:`.replay.cache_fingerprint`), and the needle-attention diagnostic is taken from the
answer's own first decoding step (:class:`~.diagnostics.AttentionProbe`).

Results are appended to ``<output_dir>/results/results-rank<r>.jsonl`` one example at a time, with the run's full
config in ``<output_dir>/config.json``. A run restarted with the same arguments skips the examples already in the
shards, so nothing is lost or duplicated: a torn last line (a write cut short, no newline) is moved to
``results-rank<r>.jsonl.cut`` and its example run again, and any other unreadable line is skipped with a warning
naming the file and line but left in place (:func:`.store.read_shard`). Reading results
(:func:`.store.read_results`, ``kvpress-phase report``) never changes a shard. One process writes each shard: a run
holds an operating-system lock on ``<output_dir>/.kvpress-phase-rank<r>.lock`` (:func:`.locking.output_lock`) and a
second run into the same directory is refused; the lock dies with its process, so a killed run never blocks a
resume. A command that fails before writing any result (a model that cannot be loaded) removes what it created there
(:func:`.store.removed_if_failed_empty`). Under ``accelerate launch`` or ``torchrun`` every rank takes every
``world_size``-th work unit and writes its own shard; rank 0 merges the shards in a deterministic order once all
ranks are done.

Where each part lives (this module re-exports the public names of the others, so imports from it keep working):

- :mod:`.config`: the configuration (:class:`~.config.EvalConfig`, its validation and fingerprint, ``SETTINGS``),
  the plan of a run (:class:`~.config.WorkUnit`, :func:`~.config.plan_units`, :func:`~.config.variants`) and the
  checks of the model (:func:`~.config.check_model`: an architecture kvpress can hook, context lengths within the
  tokenizer's limit, a warning past the positions the model knows);
- :mod:`.replay`: the recorded prefill (:class:`~.replay.Prefill`) and
  :class:`~.replay.ReplayEngine`, which compresses it under any press and decodes the answers, with the identity
  of compressed caches (:func:`~.replay.cache_fingerprint`) and the scores shared between presses;
- :mod:`.store`: the results shards (reading, resuming, :func:`~.store.record_key`, ``RESULTS_DIR``) and the
  one-writer lock (:func:`~.locking.output_lock`, :class:`~.locking.OutputDirInUse`);
- this module: the run itself (:func:`run_evaluation`: one prefill per prompt, every variant answered and appended
  to the rank's shard) and the distributed state.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import pandas as pd
import torch

from .config import SETTINGS, EvalConfig, WorkUnit, check_model, config_differences, plan_units, variants
from .presses import build_press, prefill_reads, shares_scores
from .prompting import check_tokenizer
from .replay import Prefill, ReplayEngine, cache_fingerprint
from .store import (PACKED, RESULTS_DIR, OutputDirInUse, output_lock, packed_path, read_results, read_shard, record_key,
                    removed_if_failed_empty, today_key)
from .tasks import score

__all__ = ["run_evaluation", "plan_table", "prefill_prompt", "distributed_state",
           # re-exported, as the docstring says: imports of these from the runner keep working
           "WorkUnit", "Prefill", "cache_fingerprint", "OutputDirInUse", "removed_if_failed_empty"]


# ------------------------------------------------------------------------------------------------ the run
def distributed_state():
    """(rank, world size, barrier) from accelerate when launched with several processes; (0, 1, noop) else."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import PartialState

        state = PartialState(cpu=not torch.cuda.is_available())
        return state.process_index, state.num_processes, state.wait_for_everyone
    return 0, 1, lambda: None


def run_evaluation(config: EvalConfig, model, tokenizer, output_dir: str, *, progress: bool = True,
                   max_units: Optional[int] = None, offload: Optional[str] = None) -> pd.DataFrame:
    """Run (or resume) ``config`` and return the merged per-example results.

    ``max_units`` stops after that many work units of this rank (used to test interruption). A tokenizer that
    the pipeline or the task generators cannot use (not fast, or neither a BOS token nor a chat template), a model
    whose attention layers kvpress cannot hook and a context length the pipeline would cut (:func:`check_model`)
    raise ValueError before anything is written or run. One writer per output directory: the run holds
    ``output_lock(output_dir, rank)`` and raises :class:`OutputDirInUse` (a ValueError) when another process
    holds it. ``offload="cpu"`` keeps the recorded prefill on the CPU (see :class:`ReplayEngine`); it changes
    memory use, not results.
    """
    config.validate()
    check_tokenizer(tokenizer)
    check_model(config, model, tokenizer)  # a model kvpress cannot hook, a context the pipeline would cut: refused
    rank, world, barrier = distributed_state()
    with output_lock(output_dir, rank):
        return _run_locked(config, model, tokenizer, output_dir, rank, world, barrier, progress, max_units, offload)


def plan_table(config: EvalConfig, tokenizer, output_dir: Optional[str] = None) -> pd.DataFrame:
    """What running ``config`` into ``output_dir`` would do, without a model (``kvpress-phase eval --dry-run``).

    One row per task, context length and stride: ``prompts`` (distinct prompts, one prefill each; with the offset
    protocol a sample's strides share their text, so a context is prefilled once for all of them), ``answers``
    planned, ``held`` (the answers ``output_dir`` already holds of this configuration, packed or not), ``left``,
    ``prompts_left`` (prompts with an answer left) and ``decodes_left``: the most caches the answers left decode,
    one per distinct compression of a prompt (:func:`_job`; a press without a grid offset compresses a prompt once
    for all its phases). Equal caches are known only once compressed and are decoded once, so a run can decode
    fewer. ``table.attrs["prefills_left"]``: the distinct contexts left to prefill (the run keeps its last prefill, so
    a context whose strides follow one another is prefilled once). ValueError when ``output_dir`` holds a run of
    another configuration. Reads nothing but the tokenizer and ``output_dir``, and writes nothing.
    """
    config.validate()
    check_tokenizer(tokenizer)
    done: set = set()
    if output_dir is not None:  # nothing there reads as no answers
        _check_resumes(config, output_dir)
        held = read_results(output_dir)
        done = set(held["key"]) if "key" in held else set()
    rows, contexts_left = [], set()
    for unit in plan_units(config, tokenizer):
        unit_variants = variants(config, unit.stride)
        counts = {"prompts": 0, "answers": 0, "held": 0, "prompts_left": 0, "decodes_left": 0}
        for prompt, rows_of_prompt in _prompts(unit, config.compress_question).items():
            items = [item for row in rows_of_prompt for item in _records(config, unit, row, unit_variants)]
            pending = [(row, spec, ratio, window) for row, spec, ratio, window, record in items
                       if record["key"] not in done]
            counts["prompts"] += 1
            counts["answers"] += len(items)
            counts["held"] += len(items) - len(pending)
            counts["prompts_left"] += bool(pending)
            if pending:
                contexts_left.add(prompt[0])
            counts["decodes_left"] += len({_job(*item)[1] for item in pending})
        rows.append({"task": unit.task, "context_length": unit.context_length, "stride": unit.stride, **counts})
    keys = ["task", "context_length", "stride"]
    table = pd.DataFrame(rows).groupby(keys, sort=False, as_index=False).sum()
    table.insert(table.columns.get_loc("held") + 1, "left", table["answers"] - table["held"])
    table.attrs["prefills_left"] = len(contexts_left)
    return table


def _run_locked(config, model, tokenizer, output_dir, rank, world, barrier, progress, max_units, offload):
    from tqdm.auto import tqdm

    if os.path.exists(packed_path(output_dir)):
        raise ValueError(f"--output-dir {output_dir!r} holds a packed run ({PACKED}, `kvpress-phase pack`): it is "
                         "finished and not resumed; use another --output-dir")
    os.makedirs(os.path.join(output_dir, RESULTS_DIR), exist_ok=True)
    config_path = os.path.join(output_dir, "config.json")
    saved = {"config": dataclasses.asdict(config), "fingerprint": config.fingerprint()}
    if os.path.exists(config_path):
        _check_resumes(config, output_dir)
    elif rank == 0:  # written whole or not at all: another rank may read it the moment it exists
        tmp = f"{config_path}.tmp"
        with open(tmp, "w") as fh:
            json.dump(saved, fh, indent=2)
        os.replace(tmp, config_path)

    shard_path = os.path.join(output_dir, RESULTS_DIR, f"results-rank{rank}.jsonl")
    # a torn last line is cut into <shard>.cut; keys under today's press labels, whatever spelling the run began with
    done = {today_key(r) for r in read_shard(shard_path, resume=True)}
    units = plan_units(config, tokenizer)
    if config.protocol == "offset":  # the same text at every stride: the strides of a sample share one prefill
        units = sorted(units, key=lambda u: (u.task, u.context_length, u.sample_id))
    units = units[rank::world]
    engine = ReplayEngine(model, tokenizer, offload=offload, step_by_step=config.step_by_step)
    todo = [(u, v) for u in units for v in [variants(config, u.stride)]]
    # answers kept from before count as the bar's start, not into its rate; the bar moves as each press is answered
    # (miniters=1: tqdm's adaptive miniters would hide the bar for thousands of answers after a quick stretch)
    resumed = sum(record["key"] in done
                  for u, v in todo for row in u.rows for *_, record in _records(config, u, row, v))
    bar = tqdm(total=sum(len(u.rows) * len(v) for u, v in todo), disable=not progress or rank != 0,
               desc="phase eval", unit="answer", initial=resumed, miniters=1)
    with open(shard_path, "a") as shard:
        for n_unit, (unit, unit_variants) in enumerate(todo):
            if max_units is not None and n_unit >= max_units:
                break
            _run_unit(engine, config, unit, unit_variants, done, shard, bar)
    bar.close()
    barrier()
    results = read_results(output_dir)
    return results


def _check_resumes(config: EvalConfig, output_dir: str) -> None:
    """ValueError naming the differences when ``output_dir`` holds a run of another configuration than ``config``
    (its ``config.json``); nothing when it holds none or this one's."""
    config_path = os.path.join(output_dir, "config.json")
    if not os.path.exists(config_path):
        return
    with open(config_path) as fh:
        previous = json.load(fh)
    if not config.resumes(previous.get("fingerprint")):
        differences = config_differences(previous.get("config") or {}, config)
        if differences:
            held = (f"a run with {', '.join(old for _, old, _ in differences)}; this command has "
                    f"{', '.join(new for _, _, new in differences)}")
        else:  # e.g. a run saved with a field that no longer exists
            held = "a run of another configuration (its config.json)"
        raise ValueError(f"--output-dir {output_dir!r} holds {held} (use another --output-dir, or the same "
                         "arguments to resume)")


def prefill_prompt(row: dict, compress_question: bool) -> tuple[str, str]:
    """``(context, question)`` as handed to the pipeline: with ``compress_question`` the question is appended to the
    context (compressed with it) and the question left empty, as kvpress's evaluation does (``compress_questions``);
    the answer is decoded after the chat template's question suffix and the answer prefix."""
    if compress_question:
        return row["context"] + row["question"], ""
    return row["context"], row["question"]


def _records(config, unit, row, unit_variants):
    """``(row, spec, ratio, window, record)`` of every variant of ``row``: the record holds the answer's identity
    (its ``key`` among them), the rest of it is written once the answer is known."""
    setting = SETTINGS[config.compress_question]
    for spec, ratio, window in unit_variants:
        record = {
            "task": unit.task, "context_length": unit.context_length, "stride": unit.stride,
            "window": window, "protocol": row["protocol"], "sample_id": row["sample_id"],
            "phase": row["phase"], "press": spec.label, "compression_ratio": ratio, "setting": setting,
        }
        record["key"] = record_key(record)
        yield row, spec, ratio, window, record


def _prompts(unit, compress_question: bool) -> dict[tuple, list]:
    """The rows of ``unit`` by the prompt they are asked with, ``(context, question, answer_prefix,
    max_new_tokens)``: the rows of one prompt share its prefill."""
    prompts: dict[tuple, list] = {}
    for row in unit.rows:
        context, question = prefill_prompt(row, compress_question)
        prompts.setdefault((context, question, row["answer_prefix"], row["max_new_tokens"]), []).append(row)
    return prompts


def _job(row: dict, spec, ratio: float, window) -> tuple[int, tuple]:
    """``(offset, job)``: the grid offset a variant compresses ``row``'s prompt at (0 for a press without one, which
    compresses a prompt the same way at every phase) and the job that answers it, one per distinct compression of
    the prompt."""
    offset = row["offset"] if spec.entry.grid_offset else 0
    return offset, (spec.label, ratio, window, offset)


def _run_unit(engine, config, unit, unit_variants, done, shard, bar):
    """Answer every (row, variant) of ``unit`` not yet in ``done``, appending one record per answer to ``shard``.

    Rows that share a prompt share one prefill, and every distinct compressed cache of the prompt is decoded once
    (:meth:`ReplayEngine.answer_many`, in batches of ``config.decode_batch``): a variant that does not depend on the
    row (a press without a grid offset) is answered once per prompt, and variants whose caches are equal share their
    answer. The uncompressed reference of the diagnostic comes from the ``no_press`` variant's decoding when there
    is one, else from one question forward.
    """
    from .diagnostics import needle_mass

    # what the unit's presses read decides what the prefill records (offsets do not change it)
    reads = frozenset().union(*[prefill_reads(spec) for spec, _, _ in unit_variants])
    for prompt, rows in _prompts(unit, config.compress_question).items():
        pending = [item for row in rows for item in _records(config, unit, row, unit_variants)
                   if item[-1]["key"] not in done]
        if not pending:
            continue
        context, question, answer_prefix, max_new_tokens = prompt
        encoded = engine.encode(context, [question], answer_prefix)
        if config.compress_question:
            _check_question_appended(engine, rows[0], encoded)
        state = engine.shared_prefill(encoded["context_ids"], reads=reads)
        question_ids = encoded["questions_ids"][0]
        needles = sorted({(row["needle_token_start"], row["needle_token_end"]) for row, *_ in pending})
        jobs: dict[tuple, int] = {}
        presses, shared, answered = [], [], []  # answered: per press, how many of the pending answers it gives
        for row, spec, ratio, window, record in pending:
            offset, job = _job(row, spec, ratio, window)
            if job in jobs:
                answered[jobs[job]] += 1
            else:
                jobs[job] = len(presses)
                answered.append(1)
                presses.append(build_press(spec, ratio, unit.stride, window, offset,
                                           matched_context_length=state.context_length if config.matched_cache
                                           else None))
                shared.append(shares_scores(spec))
        answers = engine.answer_many(state, presses, question_ids, max_new_tokens, share_scores=shared,
                                     needles=needles if config.diagnostics else None,
                                     batch_size=config.decode_batch, on_answer=lambda i: bar.update(answered[i]))
        full_masses: dict = {}
        if config.diagnostics:
            plain = [i for i, p in enumerate(presses) if p is None]
            if plain:
                full_masses = dict(zip(needles, answers[plain[0]]["masses"]))
            else:  # no uncompressed variant run for this prompt: one question forward
                att, cache = engine.attention_rows(state, None, question_ids)
                full_masses = {n: needle_mass(att, state, None, cache, n, question_ids.shape[1]) for n in needles}
        for row, spec, ratio, window, record in pending:
            i = jobs[_job(row, spec, ratio, window)[1]]
            press, result = presses[i], answers[i]
            needle = (row["needle_token_start"], row["needle_token_end"])
            mass = result["masses"][needles.index(needle)] if result["masses"] is not None else None
            full_mass = full_masses.get(needle)
            cache_len = result["cache_length"]
            record.update({
                "offset": row["offset"], "seed": row["seed"], "depth": row["depth"],
                "context_tokens": row["context_length"], "prefill_tokens": state.context_length,
                "answer_token_start": row["answer_token_start"],
                "answer": list(row["answer"]), "prediction": result["prediction"],
                "score": score(result["prediction"], row["answer"], unit.task),
                "cache_length": round(cache_len, 2) if cache_len != int(cache_len) else int(cache_len),
                "cache_bytes": result["cache_bytes"],
                "press_ratio": getattr(press, "compression_ratio", 0.0) if press is not None else 0.0,
                "window_ratio": getattr(press, "window_ratio", None),
                "achieved_ratio": round(1.0 - cache_len / state.context_length, 6),
                "needle_attention": mass,
                "needle_attention_ratio": (mass / full_mass) if mass is not None and full_mass else None,
            })
            shard.write(json.dumps(record) + "\n")
            shard.flush()
            done.add(record["key"])


def _check_question_appended(engine, row: dict, encoded: dict) -> None:
    """With the question compressed, the context's tokens must open the prefill unchanged (positions and phases are
    those of the context alone); ValueError naming the task otherwise."""
    alone = engine.encode(row["context"], [row["question"]], row["answer_prefix"])["context_ids"]
    end = min(alone.shape[1], row["needle_token_end"] + 1)
    if not torch.equal(alone[0, :end], encoded["context_ids"][0, :end]):
        raise ValueError(f"task {row['task']!r}: appending the question changes the context's tokens before the "
                         "needle, so --compress-question would move the needle off its phase")
