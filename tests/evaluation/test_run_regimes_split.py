"""studies/run_regimes_split.sh: the fresh split's commands, and its refusal to run a press the committed frozen
configuration does not name (run against a stand-in ``kvpress-phase`` that records its arguments)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "studies" / "run_regimes_split.sh"
PREREG = "docs/preregistration-ratio-regimes.md"
BASELINES = ["snapkv", "knorm", "streaming_llm", "chunkkv", "chunk", "expected_attention", "tova", "keydiff",
             "pyramidkv", "kvzip", "kvzip_plus", "adakv", "kvzap", "dms_kvzap"]

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


def _prereg(frozen: str) -> str:
    return f"# Pre-registration\n\n## Fresh test split\n\n`phase_aware`\n\n## Frozen configuration\n\n{frozen}\n\n## Deviations\n"


@pytest.fixture
def repo(tmp_path):
    """A git checkout holding the script and a pre-registration whose frozen configuration names G."""
    repo = tmp_path / "repo"
    (repo / "studies").mkdir(parents=True)
    (repo / "docs").mkdir()
    shutil.copy(SCRIPT, repo / "studies")
    (repo / PREREG).write_text(_prereg("Every ratio: `global_budget:scorer=kvzap`."))
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "prereg")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "kvpress-phase"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {tmp_path / "calls.txt"}\n')
    fake.chmod(0o755)
    return repo


def _run(repo: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    env = {**os.environ, "PATH": f"{repo.parent / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "studies/run_regimes_split.sh", *args], cwd=repo, env=env, capture_output=True,
                          text=True)
    calls = repo.parent / "calls.txt"
    return done, calls.read_text().splitlines() if calls.exists() else []


def _flag(call: str, name: str) -> str:
    words = call.split()
    return words[words.index(name) + 1]


def test_runs_every_split_run_with_the_frozen_press_once(repo):
    done, calls = _run(repo, "global_budget:scorer=kvzap", "smollm2")
    assert done.returncode == 0, done.stderr
    evals = [c for c in calls if c.startswith("eval ")]
    packs = [c for c in calls if c.startswith("pack ")]
    outs = ["outputs/regimes-test/smollm2/" + run for run in
            ("agnostic-1024", "question-1024", "agnostic-2048", "question-2048")]
    assert [_flag(c, "--output-dir") for c in evals] == outs
    assert packs == [f"pack {o}" for o in outs]
    for call in evals:
        presses = _flag(call, "--presses").split(",")
        assert presses == ["no_press", "chunked_stride", "phase_aware", "head_budget:floor=1.0",
                           "layer_budget:scorer=kvzap", "global_budget:scorer=kvzap", *BASELINES]
        assert (_flag(call, "--seed"), _flag(call, "--strides"), _flag(call, "--samples")) == ("53", "7,14", "8")
        assert _flag(call, "--tasks") == "niah_single,niah_multikey"
        assert _flag(call, "--compression-ratios") == "0.25,0.5,0.75"
        assert ("--query-aware" in call.split()) == ("question" in _flag(call, "--output-dir"))


def test_a_frozen_spec_already_in_the_fixed_list_is_not_repeated(repo):
    (repo / PREREG).write_text(_prereg("Ratio 0.25: `phase_aware`; 0.5 and 0.75: `global_budget:scorer=kvzap`."))
    _git(repo, "commit", "-q", "-am", "frozen")
    done, calls = _run(repo, "phase_aware,global_budget:scorer=kvzap", "smollm2")
    assert done.returncode == 0, done.stderr
    presses = _flag(calls[0], "--presses").split(",")
    assert len(presses) == len(set(presses)) == 6 + len(BASELINES)


def test_a_finished_run_is_skipped(repo):
    packed = repo / "outputs/regimes-test/smollm2/agnostic-1024/results"
    packed.mkdir(parents=True)
    (packed / "answers.parquet").write_bytes(b"")
    _, calls = _run(repo, "global_budget:scorer=kvzap", "smollm2")
    assert "outputs/regimes-test/smollm2/agnostic-1024" not in " ".join(calls)
    assert len([c for c in calls if c.startswith("eval ")]) == 3


@pytest.mark.parametrize("spec", ["threshold_budget", "global_budget:scorer=kvzap,threshold_budget", "phase_aware"])
def test_refuses_a_spec_the_frozen_configuration_does_not_name(repo, spec):
    # phase_aware stands elsewhere in the pre-registration, not under "Frozen configuration"
    done, calls = _run(repo, spec, "smollm2")
    assert done.returncode == 2
    assert "Frozen configuration" in done.stderr
    assert calls == []


def test_refuses_a_frozen_configuration_not_yet_committed(repo):
    (repo / PREREG).write_text(_prereg("Every ratio: `threshold_budget`."))
    done, calls = _run(repo, "threshold_budget", "smollm2")
    assert done.returncode == 2
    assert calls == []


def test_refuses_without_a_spec(repo):
    done, calls = _run(repo)
    assert done.returncode == 2
    assert "usage" in done.stderr
    assert calls == []
