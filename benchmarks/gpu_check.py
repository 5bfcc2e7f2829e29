"""The GPU check: one command that exercises everything a GPU changes, and writes one JSON and one Markdown summary.

    python benchmarks/gpu_check.py                # one CUDA GPU, at most about 8 minutes
    python benchmarks/gpu_check.py --small        # the same steps on tiny shapes on the CPU (seconds; run in CI)

Steps, each recorded with its status, duration and figures (a failed step does not stop the others):

1. ``parity``: the kernel parity tests on the GPU (``KVPRESS_PHASE_TEST_CUDA=1 pytest tests/kernels``). Small mode:
   Triton against the PyTorch reference for select and every pool variant on tiny shapes, through Triton's
   interpreter.
2. ``kernels``: ``benchmarks/bench_kernels.py``: bfloat16 keys/values (1, 8, N, 128) at N = 8k, 32k and 128k,
   Triton and the reference, with GB/s against a device-to-device copy measured in the same run and the speed-up
   over the reference. Small mode: float32, N = 256, both backends (the interpreter times nothing meaningful).
3. ``ragged``: ``benchmarks/bench_ragged_attention.py``: one decoding step over a ragged per-head cache with
   Llama-3.1-8B's attention shapes (32 query heads, 8 KV heads, head dim 128), bfloat16, N = 32k, 64k and 128k
   context tokens, heads keeping N / 2 on average with a fixed spread: the Triton varlen kernel's time and bandwidth
   (the kept keys and values read once) against a device-to-device copy of the same bytes in the same run (target
   >= 60%, reported as met or missed), the PyTorch reference's time and SDPA over the padded dense layout (boolean
   mask, and unmasked as under kvpress's fake keys) with varlen's speed-up over it. The varlen and the masked outputs
   must match the reference (max abs difference within 2% of the reference's largest value). Small mode: float32,
   N = 256, the kernel through the interpreter, outputs checked within 1e-4 (times mean nothing).
4. ``pipeline``: ``ChunkedStridePress`` and ``PhaseAwarePress`` through ``pipeline("kv-press-text-generation")`` on
   a bfloat16 Llama built from a config (Llama-3.1-8B's attention shapes, 2 layers, random weights) at 8k tokens,
   with sdpa and, where the ``flash_attn`` package is installed, flash-attention 2; each with the Triton and the
   PyTorch backend: every layer's cache length must equal the formula of docs/guide.md ("Exact cache length"), and the
   two backends' caches must agree within bfloat16 tolerance. Timing: after one call that takes the model's and the
   pipeline's first uses
   (``first_call``), every press and backend is called ``1 + PIPELINE_REPEATS`` times, each the same call (a fresh
   press and ``DynamicCache``, 8 new tokens), the two backends alternating: the first call of each is reported
   apart as ``cold`` (a compile or another first use shows there), the others by their median; with every call,
   the compress step alone (CUDA events around each layer's ``press.compress``) and the seconds the garbage
   collector ran during it. Small mode: a tiny float32 model at 128 tokens, sdpa, 2 repeats.
5. ``eval``: the default evaluation (``kvpress-phase eval`` with no arguments) with ``--device cuda``, with its
   answers per second. Small mode: a one-sample, three-press evaluation on the CPU.

The summaries go to ``<output-dir>/gpu_check.json`` and ``<output-dir>/gpu_check.md``. Exit code 0 when every step
passed (a step is skipped only where something optional, such as flash-attention, is not installed). The steps are
``gpu_check_steps.py``; this file runs them and writes the summaries.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the steps' module beside this file, also when this file is loaded by its path
    sys.path.insert(0, HERE)

from gpu_check_steps import STEPS  # noqa: E402

BUDGET_S = 480  # the whole check on one GPU


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU (CI)")
    p.add_argument("--output-dir", default=os.path.join("outputs", "gpu-check"))
    p.add_argument("--steps", default="parity,kernels,ragged,pipeline,eval", help="comma-separated subset of the steps")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check (default: 480)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------- report
def _markdown(summary) -> str:
    lines = [f"# GPU check ({'small, CPU' if summary['small'] else 'GPU'})", "",
             f"- device: {summary['device_name']}", f"- versions: {summary['versions']}",
             f"- date: {summary['date']}", f"- command: `{summary['command']}`",
             f"- total: {summary['seconds']:.0f} s; result: {'passed' if summary['passed'] else 'FAILED'}", "",
             "| step | status | seconds |", "|---|---|---:|"]
    for name, step in summary["steps"].items():
        lines.append(f"| {name} | {step['status']} | {step['seconds']:.1f} |")
    for name, step in summary["steps"].items():
        lines += ["", f"## {name}", ""]
        if step["status"] == "failed":
            lines += ["```", step["error"][-3000:], "```"]
            continue
        result = step.get("result") or {}
        if name == "kernels" and result:
            lines += [f"{result['device']}, {result['dtype']}", "",
                      "| N | op | backend | time (us) | GB/s | of copy | speed-up vs reference | max abs diff |",
                      "|---:|---|---|---:|---:|---:|---:|---:|"]
            for r in result["rows"]:
                sp = "" if r["speedup_vs_torch"] is None else f"{r['speedup_vs_torch']:.3g}x"
                lines.append(f"| {r['n']} | {r['op']} | {r['backend']} | {r['us']} | {r['GB/s']} | "
                             f"{r['of_copy']:.0%} | {sp} | {r['max_abs_diff'] or ''} |")
        elif name == "ragged" and result:
            lines += [f"{result['device']}, {result['dtype']}; one new token, 32 query heads, 8 KV heads, head dim "
                      "128; us per call (CUDA events, median) / GPU busy time per call; varlen GB/s: kept K and V "
                      "read once over its Triton kernels' GPU time; 'of copy' against a device-to-device copy of "
                      f"the same bytes (target >= {result['target_of_copy']:.0%})", "",
                      "| N | kept per head min / mean / max | varlen us | GB/s | of copy | target | reference us | "
                      "masked sdpa us | padded sdpa us | speed-up vs masked / padded | max rel diff |",
                      "|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
            for r in result["rows"]:
                cell = {b: f"{r[f'{b}_us']}" + ("" if r[f"{b}_gpu_us"] is None else f" / {r[f'{b}_gpu_us']}")
                        for b in ("varlen", "reference", "masked_sdpa", "padded_sdpa")}
                lines.append(f"| {r['n']} | {r['kept_min']} / {r['kept_mean']} / {r['kept_max']} | {cell['varlen']} | "
                             f"{r['varlen_GB/s']} | {r['of_copy']:.0%} | {r['target']} | {cell['reference']} | "
                             f"{cell['masked_sdpa']} | {cell['padded_sdpa']} | {r['speedup_vs_masked_sdpa']:.3g}x / "
                             f"{r['speedup_vs_padded_sdpa']:.3g}x | "
                             f"{', '.join(f'{k} {d}' for k, d in r['max_rel_diff'].items())} |")
        elif name == "pipeline" and result:
            lines += ["One pipeline call (8 new tokens): seconds, median of the repeats / the cold (first) call of "
                      "that press and backend; compress: every layer's compress step in ms, likewise.", "",
                      "| attention | press | tokens | cache length | max abs diff Triton vs torch | same answer | "
                      "s Triton | s torch | compress ms Triton | compress ms torch | repeats | cold first |",
                      "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
            for r in result["runs"]:
                cells = [f"{r[f'seconds_{b}']:.4f} / {r[f'cold_seconds_{b}']:.4f}" for b in ("triton", "torch")]
                cells += [f"{r[f'compress_seconds_{b}'] * 1e3:.2f} / {r[f'cold_compress_seconds_{b}'] * 1e3:.2f}"
                          for b in ("triton", "torch")]
                lines.append(f"| {r['attention']} | {r['press']} | {r['context_tokens']} | {r['cache_length']} | "
                             f"{r['max_abs_diff_triton_vs_torch']} | {r['same_answer']} | {' | '.join(cells)} | "
                             f"{r['repeats']} | {r['cold_first']} |")
            for attn, c in result.get("first_call", {}).items():
                lines.append(f"\nFirst call of the step ({attn}; ChunkedStridePress, torch backend; not in the table): "
                             f"{c['s']:.4f} s, compress {c['compress_s'] * 1e3:.2f} ms, garbage collector "
                             f"{c['gc_s']:.4f} s; then one full garbage collection: {c['gc_collect_s']:.4f} s.")
            gc_seconds = {b: sum(c["gc_s"] for r in result["runs"] for c in r[f"calls_{b}"])
                          for b in ("triton", "torch")}
            lines.append(f"\nGarbage collector during the timed calls: {gc_seconds['triton']:.4f} s (Triton), "
                         f"{gc_seconds['torch']:.4f} s (torch).")
            for what, why in result.get("skipped", {}).items():
                lines.append(f"\nSkipped {what}: {why}.")
        else:
            lines += ["```", json.dumps(result, indent=2), "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = _parse(argv)
    if args.small:  # before anything imports triton: the kernels then run on CPU tensors through the interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not args.small and not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device is available; --small runs the CPU version", file=sys.stderr)
        return 2
    unknown = set(args.steps.split(",")) - set(STEPS)
    if unknown:
        print(f"gpu_check: error: unknown steps {sorted(unknown)}; valid: {', '.join(STEPS)}", file=sys.stderr)
        return 2
    os.makedirs(args.output_dir, exist_ok=True)
    start = time.perf_counter()

    def timeout(seconds):
        return max(1.0, min(seconds, args.budget - (time.perf_counter() - start)))

    ctx = {"small": args.small, "device": "cpu" if args.small else "cuda", "out": args.output_dir, "timeout": timeout}
    steps = {}
    for name in args.steps.split(","):
        t0 = time.perf_counter()
        try:
            steps[name] = {"status": "ok", "result": STEPS[name](ctx)}
        except Exception as exc:  # noqa: BLE001 - record every step's failure and go on
            steps[name] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        steps[name]["seconds"] = time.perf_counter() - t0
        print(f"gpu_check: {name}: {steps[name]['status']} ({steps[name]['seconds']:.1f} s)", flush=True)

    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = "not installed"
    summary = {
        "small": args.small,
        "device_name": torch.cuda.get_device_name(0) if not args.small else f"cpu ({platform.machine()})",
        "versions": f"torch {torch.__version__}, triton {triton_version}, transformers {transformers.__version__}, "
                    f"python {platform.python_version()}",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/gpu_check.py"] + (argv if argv is not None else sys.argv[1:])),
        "seconds": time.perf_counter() - start,
        "passed": all(s["status"] == "ok" for s in steps.values()),
        "steps": steps,
    }
    with open(os.path.join(args.output_dir, "gpu_check.json"), "w") as fh:
        json.dump(summary, fh, indent=2, default=str)
    with open(os.path.join(args.output_dir, "gpu_check.md"), "w") as fh:
        fh.write(_markdown(summary))
    print(f"gpu_check: {'passed' if summary['passed'] else 'FAILED'} in {summary['seconds']:.0f} s; "
          f"{os.path.join(args.output_dir, 'gpu_check.md')}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
