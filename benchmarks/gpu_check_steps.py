"""The steps of the GPU check (``benchmarks/gpu_check.py``, whose docstring says what each one checks and measures).

Each step takes the check's context, a dict: ``small`` (tiny shapes on the CPU), ``device`` (``"cpu"`` or
``"cuda"``), ``out`` (the output folder) and ``timeout(seconds)`` (``seconds``, or what is left of the check's
budget when that is less); it returns the step's figures, or raises when what it checks does not hold.
:data:`STEPS` names them in the order the check runs them.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_parity(ctx):
    import torch

    if not ctx["small"]:
        env = dict(os.environ, KVPRESS_PHASE_TEST_CUDA="1")
        env.pop("TRITON_INTERPRET", None)
        cmd = [sys.executable, "-m", "pytest", os.path.join(ROOT, "tests", "kernels"), "-q", "-p", "no:cacheprovider"]
        job = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=ctx["timeout"](240))
        summary = (job.stdout.strip().splitlines() or [""])[-1]
        if job.returncode != 0 or "passed" not in summary:
            raise AssertionError(f"pytest exit {job.returncode}: {summary}\n{job.stdout[-3000:]}{job.stderr[-2000:]}")
        return {"pytest": summary}

    from kvpress_phase import kernels
    from kvpress_phase.core.phase import WindowLayout

    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 2, 100, 16, generator=g), torch.randn(2, 2, 100, 16, generator=g)
    scores = torch.randn(2, 2, 100, generator=g)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    checked = {}
    cases = {"select": (8, "select", "mean", "none"), "pool-mean": (8, "pool", "mean", "none"),
             "pool-score-centroid": (8, "pool", "score", "centroid"), "pool-overlap": (16, "pool", "mean", "start")}
    for name, (window, mode, weighting, rope) in cases.items():
        layout = WindowLayout.build(100, window=window, stride=8, k=4, offsets=torch.tensor([[0, 3], [5, 7]]),
                                    n_sink=4, n_local=8, batch=2, heads=2)
        outs = {}
        for backend in ("triton", "torch"):
            if mode == "select":
                outs[backend] = kernels.select_windows(keys, values, scores, layout, backend=backend)
            else:
                outs[backend] = kernels.pool_windows(keys, values, layout, scores=scores, weighting=weighting,
                                                     rope=rope, inv_freq=inv_freq, backend=backend)
        a, b = outs["triton"], outs["torch"]
        if not torch.equal(a.positions, b.positions):
            raise AssertionError(f"{name}: positions differ")
        diff = max((x - y).abs().max().item() for x, y in zip(a[:2], b[:2]))
        if diff > 1e-4:
            raise AssertionError(f"{name}: max abs difference {diff:.2e} > 1e-4")
        checked[name] = f"{diff:.1e}"
    return {"max_abs_diff": checked}


def _bench(ctx, module: str, name: str, gpu_sizes: str) -> dict:
    """Run ``benchmarks/<module>.py`` (small CPU shapes when ``ctx["small"]``, else ``gpu_sizes`` in bfloat16 on
    CUDA), its tables written to ``<name>.md`` and ``<name>.json`` in the check's folder; the JSON read back."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    bench = importlib.import_module(module)
    path = os.path.join(ctx["out"], f"{name}.json")
    if ctx["small"]:
        argv = ["--device", "cpu", "--sizes", "256", "--backends", "triton,torch", "--warmup", "0", "--repeats", "1"]
    else:
        argv = ["--device", "cuda", "--dtype", "bfloat16", "--sizes", gpu_sizes]
    with contextlib.redirect_stdout(io.StringIO()):
        bench.main(argv + ["--json", path, "--output", os.path.join(ctx["out"], f"{name}.md")])
    with open(path) as fh:
        return json.load(fh)


def step_kernels(ctx):
    measured = _bench(ctx, "bench_kernels", "kernels", "8192,32768,131072")
    rows = measured["rows"]
    diffs = [r for r in rows if r["backend"] == "triton" and "differ" in (r["max_abs_diff"] or "")]
    if diffs:
        raise AssertionError(f"Triton and reference positions differ: {diffs}")
    table = [{"n": r["n"], "op": r["op"], "backend": r["backend"], "us": round(r["seconds"] * 1e6, 1),
              "GB/s": round(r["bytes_per_s"] / 1e9, 1), "of_copy": round(r["fraction_of_copy"], 3),
              "speedup_vs_torch": None if r["speedup_vs_torch"] is None else float(f"{r['speedup_vs_torch']:.3g}"),
              "max_abs_diff": r["max_abs_diff"]} for r in rows]
    return {"device": measured["device"], "dtype": measured["dtype"], "rows": table}


RAGGED_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
"""Largest difference from the reference allowed in the ragged step, over the reference's largest absolute value."""


def step_ragged(ctx):
    measured = _bench(ctx, "bench_ragged_attention", "ragged", "32768,65536,131072")
    tol = RAGGED_TOLERANCE[measured["dtype"]]
    for r in measured["rows"]:
        if "varlen" not in r:
            raise AssertionError(f"N = {r['n']}: the Triton varlen kernel did not run")
        off = {k: d for k, d in r["max_rel_diff"].items() if not d <= tol}
        if off:
            raise AssertionError(f"N = {r['n']}: outputs differ from the reference beyond {tol} of its largest value: "
                                 f"{off}")

    def us(entry, key):
        return None if entry.get(key) is None else round(entry[key] * 1e6, 1)

    table = [{"n": r["n"], "kept_min": min(r["lengths"]), "kept_mean": round(r["kept_entries"] / len(r["lengths"])),
              "kept_max": max(r["lengths"]), "padded_length": r["padded_length"],
              "copy_GB/s": round(r["copy"]["bytes_per_s"] / 1e9, 1),
              "varlen_us": us(r["varlen"], "call_s"), "varlen_gpu_us": us(r["varlen"], "gpu_s"),
              "varlen_kernels_us": us(r["varlen"], "kernels_s"),
              "varlen_GB/s": round(r["varlen"]["bytes_per_s"] / 1e9, 1),
              "of_copy": round(r["varlen"]["fraction_of_copy"], 3), "target": r["target"],
              **{f"{b}_us": us(r[b], "call_s") for b in ("reference", "masked_sdpa", "padded_sdpa")},
              **{f"{b}_gpu_us": us(r[b], "gpu_s") for b in ("reference", "masked_sdpa", "padded_sdpa")},
              **{f"speedup_vs_{b}": float(f"{r[f'speedup_vs_{b}']['call']:.3g}")
                 for b in ("reference", "masked_sdpa", "padded_sdpa")},
              "max_rel_diff": {k: f"{d:.1e}" for k, d in r["max_rel_diff"].items()}, "timed_by": r["timed_by"]}
             for r in measured["rows"]]
    return {"device": measured["device"], "dtype": measured["dtype"], "target_of_copy": measured["target_of_copy"],
            "rows": table}


def _config_model(small: bool, attn: str, vocab: int, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if small:
        shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)
    else:  # Llama-3.1-8B's layer shapes
        shape = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     intermediate_size=14336)
    config = LlamaConfig(num_hidden_layers=2, vocab_size=vocab, max_position_embeddings=131072, rope_theta=500000.0,
                         attn_implementation="sdpa", **shape)
    torch.manual_seed(0)
    dtype = torch.float32 if small else torch.bfloat16
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    if attn != "sdpa":  # flash-attention checks the dtype and device, so switch once the model is on the GPU
        model.set_attn_implementation(attn)
    return model


PIPELINE_REPEATS = 5
"""Timed pipeline calls per press and backend after the cold one (on a GPU; 2 in small mode); the median is reported."""


class _GcClock:
    """Seconds Python's cyclic garbage collector has run while this is in ``gc.callbacks``."""

    def __init__(self):
        self.seconds, self._t0 = 0.0, None

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None


def _pipeline_call(pipe, row, press, device, gc_clock):
    """One pipeline call as the step times it: a fresh press and ``DynamicCache``, 8 new tokens. Returns the call's
    wall time (CUDA synchronised before and after), the compress step's time (every layer's ``press.compress``;
    CUDA events on a GPU, so the time on the stream, a compile or first use inside it included), the seconds the
    garbage collector ran during the call, the answer and the cache."""
    import torch
    from transformers import DynamicCache

    spans, inner = [], press.compress

    def compress(*args, **kwargs):  # kvpress's forward hook calls press.compress once per layer in the prefill
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = inner(*args, **kwargs)
            end.record()
            spans.append((start, end))
            return out
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        spans.append(time.perf_counter() - t0)
        return out

    press.compress = compress
    cache = DynamicCache()
    if device == "cuda":
        torch.cuda.synchronize()
    gc0, t0 = gc_clock.seconds, time.perf_counter()
    answer = pipe(row["context"], question=row["question"], press=press, max_new_tokens=8, cache=cache)["answer"]
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    spent = sum(s.elapsed_time(e) / 1e3 for s, e in spans) if device == "cuda" else sum(spans)
    timing = {"s": round(seconds, 4), "compress_s": round(spent, 5), "gc_s": round(gc_clock.seconds - gc0, 4)}
    return timing, answer, cache


def step_pipeline(ctx):
    import gc
    import statistics

    import torch
    from transformers import pipeline
    from transformers.utils import is_flash_attn_2_available

    from kvpress_phase import ChunkedStridePress, PhaseAwarePress
    from kvpress_phase.evaluation.tasks import generate
    from kvpress_phase.evaluation.tokenizer import build_tokenizer
    from kvpress_phase.core.phase import kept_per_window

    small, device = ctx["small"], ctx["device"]
    n_tokens = 128 if small else 8192
    repeats = 2 if small else PIPELINE_REPEATS
    tok = build_tokenizer()
    row = generate("niah_single", tok, n_samples=1, context_length=n_tokens, stride=8, phases=[3], seed=0)[0]
    impls = ["sdpa"]
    skipped = {}
    if not small:
        if is_flash_attn_2_available():
            impls.append("flash_attention_2")
        else:
            skipped["flash_attention_2"] = "the flash_attn package is not installed"
    presses = {"ChunkedStridePress": lambda b: ChunkedStridePress(0.5, stride=8, backend=b),
               "PhaseAwarePress": lambda b: PhaseAwarePress(0.5, stride=8, backend=b)}
    tol = dict(rtol=1e-5, atol=1e-4) if small else dict(rtol=1e-2, atol=1e-2)  # as tests/kernels
    results, first_calls = [], {}
    gc_clock = _GcClock()
    gc.callbacks.append(gc_clock)
    try:
        for attn in impls:
            model = _config_model(small, attn, len(tok), device)
            pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device=model.device)
            # the model's, the pipeline's and the reference path's first uses, kept out of every figure below
            first_calls[attn], _, _ = _pipeline_call(pipe, row, presses["ChunkedStridePress"]("torch"), device,
                                                     gc_clock)
            t0 = time.perf_counter()
            gc.collect()  # a full collection now, not in a timed call; its time is what one costs in this process
            first_calls[attn]["gc_collect_s"] = round(time.perf_counter() - t0, 4)
            for p, (name, make) in enumerate(presses.items()):
                caches, answers, calls = {}, {}, {"triton": [], "torch": []}
                order = ("triton", "torch") if p % 2 == 0 else ("torch", "triton")
                for r in range(1 + repeats):  # round 0: each backend's cold call; then alternating order
                    for backend in (order if r % 2 == 0 else order[::-1]):
                        timing, answers[backend], caches[backend] = _pipeline_call(pipe, row, make(backend), device,
                                                                                   gc_clock)
                        calls[backend].append(timing)
                n = len(pipe.preprocess(row["context"], [row["question"]], "", 1 << 30)["context_ids"][0])
                press = make("torch")
                span = n - press.n_sink - press.n_local
                n_windows = max(0, (span - press.stride + 1) // press.stride)
                expected = n - n_windows * (press.stride - kept_per_window(press.stride, press.compression_ratio))
                lengths = sorted({caches[b].get_seq_length(i) for b in caches for i in range(len(caches[b]))})
                if lengths != [expected]:
                    raise AssertionError(f"{attn} {name}: cache lengths {lengths}, expected {expected} for {n} tokens")
                pairs = [(getattr(caches["triton"].layers[i], t).float(), getattr(caches["torch"].layers[i], t).float())
                         for i in range(len(caches["torch"])) for t in ("keys", "values")]
                diff = max((a - b).abs().max().item() for a, b in pairs)
                if not all(torch.allclose(a, b, **tol) for a, b in pairs):
                    raise AssertionError(f"{attn} {name}: Triton and reference caches differ (max abs {diff:.2e}) "
                                         f"beyond {tol}")
                run = {"attention": attn, "press": name, "context_tokens": n, "cache_length": expected,
                       "max_abs_diff_triton_vs_torch": f"{diff:.1e}",
                       "same_answer": answers["triton"] == answers["torch"], "repeats": repeats,
                       "cold_first": order[0]}
                for b in ("triton", "torch"):
                    warm = calls[b][1:]
                    run[f"seconds_{b}"] = round(statistics.median(c["s"] for c in warm), 4)
                    run[f"compress_seconds_{b}"] = round(statistics.median(c["compress_s"] for c in warm), 5)
                    run[f"cold_seconds_{b}"] = calls[b][0]["s"]
                    run[f"cold_compress_seconds_{b}"] = calls[b][0]["compress_s"]
                    run[f"calls_{b}"] = calls[b]
                results.append(run)
            del model, pipe
            if not small:
                torch.cuda.empty_cache()
    finally:
        gc.callbacks.remove(gc_clock)
    return {"dtype": "float32" if small else "bfloat16", "runs": results, "skipped": skipped,
            "first_call": first_calls}


def step_eval(ctx):
    import pandas as pd

    from kvpress_phase import cli

    out = os.path.join(ctx["out"], "eval")
    if ctx["small"]:
        argv = ["eval", "--device", "cpu", "--tasks", "niah_single", "--presses", "no_press,chunked_stride,phase_aware",
                "--strides", "4", "--context-lengths", "64", "--samples", "1", "--bootstrap", "100"]
    else:
        argv = ["eval", "--device", "cuda"]
    argv += ["--output-dir", out, "--no-progress"]
    if os.path.exists(os.path.join(out, "config.json")):  # a fresh run, not a resume
        import shutil

        shutil.rmtree(out)
    t0 = time.perf_counter()
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    seconds = time.perf_counter() - t0
    if code != 0:
        raise AssertionError(f"kvpress-phase {' '.join(argv)} exited {code}: {err.getvalue()[-2000:]}")
    answers = len(pd.read_csv(os.path.join(out, "results.csv")))
    return {"command": "kvpress-phase " + " ".join(argv), "answers": answers, "seconds": round(seconds, 1),
            "answers_per_s": round(answers / seconds, 1)}


STEPS = {"parity": step_parity, "kernels": step_kernels, "ragged": step_ragged, "pipeline": step_pipeline,
         "eval": step_eval}
