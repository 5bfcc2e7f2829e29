"""The replay runner gives the kvpress pipeline's answers, resumes without loss or duplicates, and shards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache, pipeline

from tiny_models import tiny_model
from kvpress_phase.evaluation.presses import build_press, parse_press_spec
from kvpress_phase.evaluation.config import EvalConfig, check_context_lengths
from kvpress_phase.evaluation.replay import ReplayEngine
from kvpress_phase.evaluation.store import read_results
from kvpress_phase.evaluation.runner import run_evaluation
from kvpress_phase.evaluation.tasks import generate
from kvpress_phase.evaluation.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def word_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(word_tokenizer):
    return tiny_model("qwen3", vocab_size=len(word_tokenizer), seed=3)


PRESSES = ["no_press", "chunked_stride", "chunked_stride:mode=select", "phase_aware", "phase_aware:scorer=knorm",
           "knorm", "snapkv", "streaming_llm", "chunkkv", "chunk", "expected_attention", "tova", "keydiff"]
# pyramidkv and kvzip: tests/evaluation/test_batched_decoding.py (kvpress's pipeline cannot run them here)


def test_replay_gives_the_pipeline_answers(model, word_tokenizer):
    rows = generate("niah_single", word_tokenizer, n_samples=2, context_length=200, stride=8, phases=[1, 6],
                    protocol="offset", seed=5)
    engine = ReplayEngine(model, word_tokenizer, step_by_step=True)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=word_tokenizer, device="cpu")
    for row in rows:
        encoded = engine.encode(row["context"], [row["question"]], row["answer_prefix"])
        state = engine.prefill(encoded["context_ids"])
        for text in PRESSES:
            spec = parse_press_spec(text)
            for offset in (0, row["offset"]):
                press_a = build_press(spec, 0.5, 8, None, offset)
                press_b = build_press(spec, 0.5, 8, None, offset)
                replayed = engine.answer_many(state, [press_a], encoded["questions_ids"][0], 6, batch_size=1)[0]
                replay_cache = engine.compressed_cache(state, press_a)
                cache = DynamicCache()
                direct = pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"],
                              press=press_b, max_new_tokens=6, cache=cache)["answer"]
                assert replayed["prediction"] == direct, (text, offset)
                assert replay_cache.get_seq_length(0) == cache.get_seq_length(0)


def _config(**kw):
    base = dict(tasks=["niah_single"], presses=["no_press", "chunked_stride", "knorm"], compression_ratios=[0.5],
                strides=[4], context_lengths=[128], samples=3, seed=1)
    base.update(kw)
    return EvalConfig(**base)


def test_interrupted_run_resumes_without_loss_or_duplicates(model, word_tokenizer, tmp_path):
    config = _config()
    full = run_evaluation(config, model, word_tokenizer, str(tmp_path / "full"), progress=False)
    assert len(full) == 3 * 4 * 3  # samples x phases x presses

    out = str(tmp_path / "resumed")
    run_evaluation(config, model, word_tokenizer, out, progress=False, max_units=1)
    shard = os.path.join(out, "results", "results-rank0.jsonl")
    with open(shard, "a") as fh:  # a crash in the middle of a write
        fh.write('{"task": "niah_single", "torn')
    partial = read_results(out)
    assert 0 < len(partial) < len(full)
    resumed = run_evaluation(config, model, word_tokenizer, out, progress=False)
    assert len(resumed) == len(full) and resumed["key"].is_unique
    cols = ["key", "prediction", "score"]
    assert resumed[cols].equals(full[cols])
    with open(shard) as fh:
        assert all(json.loads(line) for line in fh)


def test_progress_bar_starts_at_the_kept_answers_and_moves_as_answers_are_known(model, word_tokenizer, tmp_path,
                                                                               monkeypatch):
    import tqdm.auto

    config, out = _config(), str(tmp_path / "run")
    shard = os.path.join(out, "results", "results-rank0.jsonl")
    bars = []

    class Recorder:  # the bar's count beside the answers written when it moves
        def __init__(self, total, initial, disable, **kw):
            self.total, self.n, self.initial, self.seen = total, initial, initial, []
            bars.append(self)

        def update(self, n=1):
            self.n += n
            with open(shard) as fh:
                self.seen.append((self.n, sum(1 for _ in fh)))

        def close(self):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorder)
    kept = len(run_evaluation(config, model, word_tokenizer, out, progress=True, max_units=1))
    resumed = run_evaluation(config, model, word_tokenizer, out, progress=True)
    first, second = bars
    assert first.initial == 0 and second.initial == kept > 0
    assert second.n == second.total == len(resumed) == 3 * 4 * 3  # samples x phases x presses
    assert all(n >= written for n, written in second.seen)
    # the bar counts a press's answers when they are decoded, before its prompt's records are written
    assert any(n > written for n, written in second.seen)


def test_changed_arguments_do_not_mix_into_old_results(model, word_tokenizer, tmp_path):
    run_evaluation(_config(samples=1), model, word_tokenizer, str(tmp_path), progress=False)
    with pytest.raises(ValueError, match=r"holds a run with --samples 1; this command has --samples 2 \(use another "
                                         r"--output-dir, or the same arguments to resume\)"):
        run_evaluation(_config(samples=2), model, word_tokenizer, str(tmp_path), progress=False)


def test_config_json_never_appears_half_written(model, word_tokenizer, tmp_path, monkeypatch):
    # under torchrun every other rank reads config.json as soon as it exists: rank 0 must not create it empty and
    # fill it afterwards (a rank that read it in between failed with a JSON error)
    config_path = tmp_path / "config.json"
    seen = []
    real_dump = json.dump

    def dump(obj, fh, **kw):
        seen.append(config_path.exists())
        return real_dump(obj, fh, **kw)

    monkeypatch.setattr(json, "dump", dump)
    run_evaluation(_config(samples=1), model, word_tokenizer, str(tmp_path), progress=False)
    assert seen and not any(seen), "config.json existed while its contents were being written"
    assert json.loads(config_path.read_text())["config"]["samples"] == 1
    assert not list(tmp_path.glob("*.tmp"))


TWO_PROCESS_TIMEOUT = 900
"""Seconds the two-process job may take: about 30 s on 2 idle cores, many times that when other jobs share them."""


@pytest.mark.slow
def test_two_processes_write_shards_and_merge_deterministically(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import sys\n"
        "import torch\n"
        "torch.set_num_threads(1)  # two workers on a machine that may be shared: one thread each\n"
        f"sys.path.insert(0, {os.path.dirname(__file__) + '/..'!r})\n"
        "from tiny_models import tiny_model\n"
        "from kvpress_phase.evaluation.config import EvalConfig\n"
        "from kvpress_phase.evaluation.runner import run_evaluation\n"
        "from kvpress_phase.evaluation.tokenizer import build_tokenizer\n"
        "tok = build_tokenizer()\n"
        "model = tiny_model('qwen3', vocab_size=len(tok), seed=3)\n"
        "cfg = EvalConfig(tasks=['niah_single'], presses=['no_press', 'chunked_stride', 'knorm'],\n"
        "                 strides=[4], context_lengths=[128], samples=3, seed=1)\n"
        "run_evaluation(cfg, model, tok, sys.argv[1], progress=False)\n"
    )
    out = tmp_path / "dist"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # --standalone: the rendezvous store binds a free port itself and keeps it (a port picked here and released
    # could be taken before torchrun binds it)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(out)]
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)  # its own process group: a timeout ends the workers too
    try:
        stdout, stderr = job.communicate(timeout=TWO_PROCESS_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        stdout, stderr = job.communicate()
        pytest.fail(f"the two-process run (torchrun --standalone --nproc_per_node 2, one thread per worker) did not "
                    f"finish within {TWO_PROCESS_TIMEOUT} s; its stderr ends with:\n{stderr[-3000:]}")
    if job.returncode != 0:  # each worker's own lines: the one that failed first is not the one that printed last
        per_rank = {r: [ln for ln in stderr.splitlines() if ln.startswith(f"[rank{r}]")][-25:] for r in (0, 1)}
        pytest.fail(f"torchrun exited with code {job.returncode}:\n" + "\n".join(
            f"--- rank {r} ---\n" + "\n".join(lines) for r, lines in per_rank.items()) + f"\n--- tail ---\n{stderr[-1500:]}")
    shards = sorted(os.listdir(out / "results"))
    assert shards == ["results-rank0.jsonl", "results-rank1.jsonl"]
    merged = read_results(str(out))
    single = run_evaluation(_config(), tiny_model("qwen3", vocab_size=len(build_tokenizer()), seed=3),
                            build_tokenizer(), str(tmp_path / "single"), progress=False)
    cols = ["key", "prediction", "score"]
    assert merged[cols].equals(single[cols])


def test_needle_attention_diagnostic(model, word_tokenizer):
    from kvpress_phase.evaluation.diagnostics import entry_spans, needle_attention

    row = generate("niah_single", word_tokenizer, n_samples=1, context_length=200, stride=8, phases=[3])[0]
    engine = ReplayEngine(model, word_tokenizer)
    encoded = engine.encode(row["context"], [row["question"]], row["answer_prefix"])
    state = engine.prefill(encoded["context_ids"])
    needle = (row["needle_token_start"], row["needle_token_end"])
    q = encoded["questions_ids"][0]
    full = needle_attention(engine, state, None, q, needle)
    assert 0 < full < 1
    # a press that keeps every entry keeps all the mass; one that drops the needle keeps none
    assert needle_attention(engine, state, build_press(parse_press_spec("knorm"), 0.0, 8, None, 0), q, needle) == \
        pytest.approx(full, rel=1e-5)
    streaming = build_press(parse_press_spec("streaming_llm"), 0.9, 8, None, 0)
    if needle[0] > 20 and needle[1] < 200 - 20:
        assert needle_attention(engine, state, streaming, q, needle) == 0.0
    # selection presses' kept entries are found among the original keys
    knorm = build_press(parse_press_spec("knorm"), 0.5, 8, None, 0)
    cache = engine.compressed_cache(state, knorm)
    keys = state.inputs[0][2]
    start, end = entry_spans(knorm, 0, keys, cache.layers[0].keys)
    assert (start >= 0).all() and (end == start + 1).all()
    assert torch.equal(keys.gather(2, start[..., None].expand(-1, -1, -1, keys.shape[-1])), cache.layers[0].keys)
    # pooled entries cover their groups
    ours = build_press(parse_press_spec("chunked_stride:mode=pool"), 0.75, 8, None, 0)
    cache = engine.compressed_cache(state, ours)
    start, end = entry_spans(ours, 0, keys, cache.layers[0].keys)
    assert ((end - start) <= 8).all() and ((end - start) >= 1).all() and (end - start).max() == 4
    # the default ChunkedStridePress selects: one original token per entry
    ours = build_press(parse_press_spec("chunked_stride"), 0.75, 8, None, 0)
    cache = engine.compressed_cache(state, ours)
    start, end = entry_spans(ours, 0, keys, cache.layers[0].keys)
    assert (end == start + 1).all()
    assert torch.equal(keys.gather(2, start[..., None].expand(-1, -1, -1, keys.shape[-1])), cache.layers[0].keys)


def test_context_longer_than_the_model_positions_warns(model):
    assert check_context_lengths(EvalConfig(context_lengths=[512, 2048]), model) is None  # tiny model: 2048
    with pytest.warns(UserWarning, match=r"context length 4096, 9000 exceeds the model's max_position_embeddings "
                                         r"\(2048\), and the model was not trained on positions past it"):
        check_context_lengths(EvalConfig(context_lengths=[512, 9000, 4096]), model)


def test_context_longer_than_the_builtin_model_positions_says_what_it_was_trained_on():
    from kvpress_phase import load_builtin_model

    builtin, _ = load_builtin_model()
    assert check_context_lengths(EvalConfig(context_lengths=[512, 2048]), builtin) is None
    with pytest.warns(UserWarning, match=r"context length 100000 exceeds the 2048 tokens the built-in model 'builtin' "
                                         r"was trained on and its max_position_embeddings \(4096\)"):
        check_context_lengths(EvalConfig(context_lengths=[100_000]), builtin)
    # past the training length but within the positions: the same rule (a warning), the positions not named
    with pytest.warns(UserWarning, match=r"context length 3000, 100000 exceeds the 2048 tokens the built-in model "
                                         r"'builtin' was trained on and its max"):
        check_context_lengths(EvalConfig(context_lengths=[3000, 100_000]), builtin)
    with pytest.warns(UserWarning, match=r"context length 3000 exceeds the 2048 tokens the built-in model 'builtin' "
                                         r"was trained on: its rotary positions extrapolate there"):
        check_context_lengths(EvalConfig(context_lengths=[3000]), builtin)


def _row_state(engine, word_tokenizer, phase=3, **prefill_kw):
    row = generate("niah_single", word_tokenizer, n_samples=1, context_length=200, stride=8, phases=[phase])[0]
    encoded = engine.encode(row["context"], [row["question"]], row["answer_prefix"])
    return row, encoded, engine.prefill(encoded["context_ids"], **prefill_kw)


def test_probe_diagnostic_matches_the_eager_rerun(model, word_tokenizer):
    """The diagnostic the runner takes from the answer's first decoding step equals the stand-alone eager one."""
    from kvpress_phase.evaluation.diagnostics import needle_attention, needle_mass

    engine = ReplayEngine(model, word_tokenizer, step_by_step=True)
    row, encoded, state = _row_state(engine, word_tokenizer)
    needle = (row["needle_token_start"], row["needle_token_end"])
    q = encoded["questions_ids"][0]
    rows, cache = engine.attention_rows(state, None, q)
    full = needle_mass(rows, state, None, cache, needle, q.shape[1])
    assert full == pytest.approx(needle_attention(engine, state, None, q, needle), rel=1e-5, abs=1e-7)
    assert 0 < full < 1
    checked = 0
    for text in PRESSES[1:]:
        spec = parse_press_spec(text)
        for ratio in (0.25, 0.75):
            press = build_press(spec, ratio, 8, None, 2)
            recorded = engine.answer_many(state, [press], q, 4, needles=[needle], batch_size=1)[0]
            fast = recorded["masses"][0]
            reference = needle_attention(engine, state, build_press(spec, ratio, 8, None, 2), q, needle)
            assert fast == pytest.approx(reference, rel=1e-5, abs=1e-7), (text, ratio)
            # recording changes nothing in the answers
            plain = engine.answer_many(state, [build_press(spec, ratio, 8, None, 2)], q, 4, batch_size=1)[0]
            assert recorded["prediction"] == plain["prediction"]
            checked += reference > 0
    assert checked > 5  # not a comparison of zeros


def test_probe_rotation_handles_partial_rotary():
    from kvpress_phase.evaluation.diagnostics import _rotate

    x = torch.randn(1, 2, 3, 8)
    cos, sin = torch.rand(1, 3, 4), torch.rand(1, 3, 4)
    out = _rotate(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:])
    half = torch.cat((-x[..., 2:4], x[..., :2]), dim=-1)
    assert torch.allclose(out[..., :4], x[..., :4] * cos[:, None] + half * sin[:, None])


def test_prefill_records_only_what_the_presses_read(model, word_tokenizer):
    from kvpress_phase.evaluation.presses import prefill_reads

    engine = ReplayEngine(model, word_tokenizer, step_by_step=True)
    lean_presses = ["no_press", "chunked_stride", "chunked_stride:mode=pool", "phase_aware", "keydiff",
                    "phase_aware:scorer=knorm", "staggered_window:scorer=knorm",
                    "knorm", "streaming_llm", "chunk"]
    reads = frozenset().union(*[prefill_reads(parse_press_spec(t)) for t in lean_presses])
    row, encoded, full = _row_state(engine, word_tokenizer)
    lean = engine.prefill(encoded["context_ids"], reads=reads)
    assert "hidden_states" not in lean.reads
    assert all(hidden.device.type == "meta" for _, hidden, *_ in lean.inputs.values())
    hidden_bytes = sum(h.numel() * h.element_size() for _, h, *_ in full.inputs.values())
    assert full.captured_bytes() - lean.captured_bytes() == hidden_bytes > 0
    q = encoded["questions_ids"][0]
    for text in lean_presses:
        spec = parse_press_spec(text)
        a = engine.answer_many(full, [build_press(spec, 0.5, 8, None, 1)], q, 6, batch_size=1)[0]["prediction"]
        b = engine.answer_many(lean, [build_press(spec, 0.5, 8, None, 1)], q, 6, batch_size=1)[0]["prediction"]
        assert a == b, text
    # presses that read the hidden states get them, and a prefill without them refuses such a press
    for text in ("snapkv", "chunkkv", "phase_aware:scorer=snapkv", "chunked_stride:mode=select:scorer=snapkv"):
        assert "hidden_states" in prefill_reads(parse_press_spec(text))
        with pytest.raises(ValueError, match="hidden_states"):
            engine.compressed_cache(lean, build_press(parse_press_spec(text), 0.5, 8, None, 0))


def test_offloaded_capture_gives_the_same_answers(model, word_tokenizer):
    engine = ReplayEngine(model, word_tokenizer, step_by_step=True)
    offloaded = ReplayEngine(model, word_tokenizer, offload="cpu", step_by_step=True)
    row, encoded, state = _row_state(engine, word_tokenizer, phase=5)
    off_state = offloaded.prefill(encoded["context_ids"])
    assert all(layer.keys.shape[2] == 0 for layer in off_state.cache.layers)  # the cache itself holds nothing
    assert off_state.captured_bytes() == state.captured_bytes()
    q = encoded["questions_ids"][0]
    for text in PRESSES:
        spec = parse_press_spec(text)
        a = engine.answer_many(state, [build_press(spec, 0.5, 8, None, 2)], q, 6, batch_size=1)[0]
        b = offloaded.answer_many(off_state, [build_press(spec, 0.5, 8, None, 2)], q, 6, batch_size=1)[0]
        assert a["prediction"] == b["prediction"] and a["cache_length"] == b["cache_length"], text
    with pytest.raises(ValueError, match="offload"):
        ReplayEngine(model, word_tokenizer, offload="disk")


def test_cache_fingerprint_tells_caches_apart(model, word_tokenizer):
    from kvpress_phase.evaluation.replay import cache_fingerprint

    engine = ReplayEngine(model, word_tokenizer)
    row, encoded, state = _row_state(engine, word_tokenizer)
    window = parse_press_spec("staggered_window:scorer=knorm")  # aligned grids: the offset is unused
    aligned = [engine.compressed_cache(state, build_press(window, 0.5, 8, None, o)) for o in (0, 3)]
    fixed = [engine.compressed_cache(state, build_press(parse_press_spec("chunked_stride"), 0.5, 8, None, o))
             for o in (0, 3)]
    assert cache_fingerprint(state, aligned[0]) == cache_fingerprint(state, aligned[1])  # the offset is unused
    assert cache_fingerprint(state, fixed[0]) != cache_fingerprint(state, fixed[1])
    nudged = engine.compressed_cache(state, build_press(parse_press_spec("chunked_stride"), 0.5, 8, None, 0))
    layer = nudged.layers[len(nudged.layers) - 1]
    values = layer.values.clone()
    values[0, -1, 7, 5] = torch.nextafter(values[0, -1, 7, 5], torch.tensor(float("inf")))  # one ulp of one element
    layer.values = values
    assert cache_fingerprint(state, nudged) != cache_fingerprint(state, fixed[0])
    assert cache_fingerprint(state, engine.compressed_cache(state, None)) != cache_fingerprint(state, fixed[0])


def test_run_evaluation_gives_the_pipeline_answers(model, word_tokenizer, tmp_path):
    """End to end, with every reuse the runner makes (offset protocol: one context for all phases)."""
    presses = ["no_press", "chunked_stride", "phase_aware", "phase_aware:scorer=keydiff", "knorm", "snapkv"]
    config = _config(presses=presses, protocol="offset", samples=1, context_lengths=[160])
    results = run_evaluation(config, model, word_tokenizer, str(tmp_path), progress=False)
    rows = generate("niah_single", word_tokenizer, n_samples=1, context_length=160, stride=4, phases=[0, 1, 2, 3],
                    protocol="offset", seed=1)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=word_tokenizer, device="cpu")
    got = {(r.phase, r.press): r.prediction for r in results.itertuples()}
    assert len(got) == 4 * len(presses)
    for row in rows:
        for text in presses:
            spec = parse_press_spec(text)
            offset = row["offset"] if spec.entry.grid_offset else 0
            direct = pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"],
                          press=build_press(spec, 0.5, 4, None, offset), max_new_tokens=row["max_new_tokens"])
            assert got[(row["phase"], spec.label)] == direct["answer"], (row["phase"], text)
    assert results["needle_attention_ratio"].notna().all()


@pytest.mark.parametrize("text,shared", [
    ("snapkv", True), ("pyramidkv", True), ("kvzap", True), ("phase_aware", True),
    ("phase_aware:scorer=snapkv", True), ("chunked_stride:scorer=tova", True),
    ("phase_aware:scorer=random", False), ("phase_aware:scorer=kvzip", False), ("chunk", False),
    ("streaming_llm", False),
    ("chunkkv:scorer=keydiff", False), ("adakv", False), ("kvzip", False), ("no_press", False)])
def test_the_registry_decides_which_scores_are_shared(text, shared):
    from kvpress_phase.evaluation.presses import shares_scores

    assert shares_scores(parse_press_spec(text)) is shared


def _shared_by_the_registry():
    from kvpress_phase.evaluation.presses import REGISTRY

    # kvzap's scorer ships for the real models only (its scores are a map of the hidden states: no ratio in them)
    names = [name for name, entry in REGISTRY.items() if entry.shared_scores and name != "kvzap"]
    return names + ["phase_aware:scorer=snapkv", "phase_aware:scorer=tova:allocate=layers"]


@pytest.mark.parametrize("text", _shared_by_the_registry())
def test_shared_scores_give_the_caches_fresh_scores_give(model, word_tokenizer, text):
    """Scores shared over ratios and offsets build the caches that scores computed afresh build, for every press
    whose registry entry allows sharing (a press whose scores depend on the ratio, as StreamingLLM's do, must not be
    marked), and only a press that shares them fills the prefill's score memo."""
    from kvpress_phase.evaluation.replay import cache_fingerprint

    row = generate("niah_single", word_tokenizer, n_samples=1, context_length=200, stride=8, phases=[3])[0]
    engine = ReplayEngine(model, word_tokenizer)
    state = engine.prefill(engine.encode(row["context"], [row["question"]], row["answer_prefix"])["context_ids"])
    spec = parse_press_spec(text)
    jobs = [(ratio, offset) for ratio in (0.25, 0.5, 0.75) for offset in (0, 3)]
    fresh = [cache_fingerprint(state, engine.compressed_cache(state, build_press(spec, r, 8, None, o)))
             for r, o in jobs]
    assert not state.memo.get("scores")
    shared = [cache_fingerprint(state, engine.compressed_cache(state, build_press(spec, r, 8, None, o),
                                                               share_scores=True)) for r, o in jobs]
    assert state.memo["scores"] and shared == fresh
    assert len(set(fresh)) > 1  # the ratios do build different caches
