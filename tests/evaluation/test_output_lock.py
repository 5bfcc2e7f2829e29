"""One writer per output directory: a second run is refused with exit 2, a killed run's lock does not block."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from kvpress_phase import cli
from kvpress_phase.evaluation.store import OutputDirInUse, lock_path, output_lock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def _eval_args(model_dir, out):
    return ["eval", "--model", model_dir, "--tasks", "niah_single", "--presses", "no_press,chunked_stride",
            "--strides", "4", "--context-lengths", "128", "--samples", "2", "--output-dir", str(out),
            "--no-progress", "--bootstrap", "100"]


def _holder(out):
    """A separate process that holds the output directory's lock until it is killed."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        from kvpress_phase.evaluation.store import output_lock
        with output_lock({str(out)!r}):
            print("locked", flush=True)
            time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _shard_keys(out):
    with open(os.path.join(out, "results", "results-rank0.jsonl")) as fh:
        return [json.loads(line)["key"] for line in fh]


def test_second_writer_is_refused_and_a_killed_writer_does_not_block(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    holder = _holder(out)
    try:
        assert cli.main(_eval_args(model_dir, out)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "in use by another run" in err and "Traceback" not in err
        assert not (out / "results").exists()  # nothing was written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert os.path.exists(lock_path(str(out)))  # the killed holder's lock file is still there ...
    assert cli.main(_eval_args(model_dir, out)) == 0  # ... and does not block
    keys = _shard_keys(out)
    assert len(keys) == len(set(keys)) == 2 * 4 * 2  # samples x phases x presses


def test_lock_is_reentrant_in_one_process_and_per_shard(tmp_path):
    with output_lock(str(tmp_path)):
        with output_lock(str(tmp_path)):  # run_evaluation inside the command's own lock
            pass
        with output_lock(str(tmp_path), rank=1):  # another rank's shard is another lock
            pass
    holder = _holder(tmp_path)
    try:
        with pytest.raises(OutputDirInUse, match="in use"):
            with output_lock(str(tmp_path)):
                pass
        with output_lock(str(tmp_path), rank=1):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with output_lock(str(tmp_path)):
        pass


@pytest.mark.slow
def test_two_commands_started_together_write_no_duplicates(model_dir, tmp_path):
    """The reported case: two `kvpress-phase eval` runs into one directory at the same time."""
    out = tmp_path / "run"
    args = _eval_args(model_dir, out)
    args[args.index("--samples") + 1] = "12"  # a few seconds of work, so that the two runs overlap
    args[args.index("--context-lengths") + 1] = "512"
    args[args.index("--presses") + 1] = "no_press,chunked_stride,knorm,phase_aware"
    cmd = [sys.executable, "-m", "kvpress_phase.cli"] + args
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outcomes = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(code for code, _ in outcomes) == [0, 2], outcomes
    refused = next(err for code, err in outcomes if code == 2).strip().splitlines()
    assert len(refused) == 1 and "in use by another run" in refused[0]
    keys = _shard_keys(out)
    assert len(keys) == len(set(keys)) == 12 * 4 * 4  # samples x phases x presses
