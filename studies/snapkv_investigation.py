"""Why SnapKV, PyramidKV and ExpectedAttention score ~0 on SmolLM2's needle tasks: the checks behind
``docs/results/real-model/snapkv-investigation.md``.

Four sections (``--sections``, all by default), on SmolLM2-135M-Instruct (``load_builtin_model(name="smollm2")``)
and seeded ``niah_single``/``niah_multikey`` rows of ``--context-length`` tokens:

* ``pipeline``: kvpress's own ``kv-press-text-generation`` pipeline against our ``ReplayEngine`` on the same rows
  (answers printed side by side; batch 1, as the pipeline decodes);
* ``screen``: accuracy of SnapKV at several ratios, windows and kernels, of variants that protect the attention
  sink, the chat-template prefix or the needle, or that average the scores over heads, and of TOVA, Knorm,
  ExpectedAttention and PyramidKV, with the question kept out of the prefill (query-agnostic) and compressed with
  the context (query-aware);
* ``scores``: what each scorer evicts first, from the compress inputs that kvpress's forward hook hands to
  ``press.score`` (recorded once per context by the replay engine): rank of the answer's tokens per layer and KV
  head, whether the sink is kept, what the evicted entries are, and where SnapKV's observation window puts its
  attention;
* ``conversion``: whether the converted model's attention is right: kvpress's window attention against the model's
  eager attention weights, and the language-model loss of a text under the converted q/k layout and RoPE base
  against the alternatives.

    python -m studies.snapkv_investigation                      # all sections, 4 samples per task (about 5 min, CPU)
    python -m studies.snapkv_investigation --sections scores --samples 1
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from kvpress import ScorerPress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ("niah_single", "niah_multikey")
SECTIONS = ("pipeline", "screen", "scores", "conversion")


@dataclass
class Protected(ScorerPress):
    """``press``'s scores, with the spans ``keep`` (``(start, end)`` token ranges) always kept and, with
    ``head_mean``, the scores averaged over KV heads (one selection for all heads, as TOVA's)."""

    press: Optional[ScorerPress] = None
    keep: tuple = ()
    head_mean: bool = False

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        scores = self.press.score(module, hidden_states, keys, values, attentions, kwargs)
        if self.head_mean:
            scores = scores.mean(1, keepdim=True).expand_as(scores).clone()
        top = scores.max() + 1
        for start, end in self.keep:
            scores[..., start:end] = top
        return scores


@dataclass
class Row:
    task: str
    row: dict
    query_aware: bool
    encoded: dict = field(repr=False)


def load(args):
    from kvpress_phase import load_builtin_model
    from kvpress_phase.evaluation.replay import ReplayEngine

    model, tokenizer = load_builtin_model(name="smollm2")
    return model, tokenizer, ReplayEngine(model, tokenizer)


def rows_of(tokenizer, task, args):
    from kvpress_phase.evaluation.tasks import generate

    return list(generate(task, tokenizer, n_samples=args.samples, context_length=args.context_length, stride=8,
                         phases=[0], protocol="offset", seed=args.seed))


def encode(engine, row, query_aware):
    from kvpress_phase.evaluation.runner import prefill_prompt

    context, question = prefill_prompt(row, query_aware)
    return engine.encode(context, [question], row["answer_prefix"])


# ------------------------------------------------------------------------------------------------ pipeline
def section_pipeline(model, tokenizer, engine, args):
    from kvpress import ExpectedAttentionPress, KnormPress, SnapKVPress, TOVAPress
    from transformers import pipeline

    from kvpress_phase.evaluation.tasks import score

    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    presses = {"no press": lambda: None, "SnapKV 0.125": lambda: SnapKVPress(0.125),
               "SnapKV 0.5": lambda: SnapKVPress(0.5), "TOVA 0.5": lambda: TOVAPress(0.5),
               "Knorm 0.5": lambda: KnormPress(0.5), "ExpectedAttention 0.5": lambda: ExpectedAttentionPress(0.5)}
    print("## kvpress's pipeline against our replay engine (niah_single, query-agnostic)\n")
    print("| sample | answer | press | pipeline | replay engine | same |\n|---|---|---|---|---|---|")
    same = total = 0
    for i, row in enumerate(rows_of(tokenizer, "niah_single", args)):
        enc = encode(engine, row, False)
        state = engine.prefill(enc["context_ids"])
        for name, make in presses.items():
            a = pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"], press=make(),
                     max_new_tokens=row["max_new_tokens"])["answer"]
            b = engine.answer_many(state, [make()], enc["questions_ids"][0], row["max_new_tokens"],
                                   batch_size=1)[0]["prediction"]
            same += a == b
            total += 1
            print(f"| {i} | {row['answer'][0]} | {name} | {a.strip()!r} ({score(a, row['answer'], 'niah_single'):.0f}) "
                  f"| {b.strip()!r} | {'yes' if a == b else 'NO'} |")
    print(f"\nidentical answers: {same} of {total}\n")


# ------------------------------------------------------------------------------------------------ screen
def screen_presses(ratio, needle, prefix):
    from kvpress import ExpectedAttentionPress, KnormPress, PyramidKVPress, SnapKVPress, TOVAPress

    return {
        "SnapKV (window 64, kernel 5)": SnapKVPress(ratio),
        "SnapKV window 1": SnapKVPress(ratio, window_size=1),
        "SnapKV window 8": SnapKVPress(ratio, window_size=8),
        "SnapKV window 16": SnapKVPress(ratio, window_size=16),
        "SnapKV kernel 1": SnapKVPress(ratio, kernel_size=1),
        "SnapKV, sink kept": Protected(ratio, SnapKVPress(ratio), keep=((0, 1),)),
        f"SnapKV, template prefix ({prefix} tokens) kept": Protected(ratio, SnapKVPress(ratio), keep=((0, prefix),)),
        "SnapKV, needle kept": Protected(ratio, SnapKVPress(ratio), keep=(needle,)),
        "SnapKV, scores averaged over heads": Protected(ratio, SnapKVPress(ratio), head_mean=True),
        "SnapKV window 1 kernel 1 (TOVA per head)": SnapKVPress(ratio, window_size=1, kernel_size=1),
        "TOVA": TOVAPress(ratio),
        "PyramidKV": PyramidKVPress(ratio),
        "ExpectedAttention": ExpectedAttentionPress(ratio),
        "ExpectedAttention, needle kept": Protected(ratio, ExpectedAttentionPress(ratio), keep=(needle,)),
        "Knorm": KnormPress(ratio),
    }


def section_screen(model, tokenizer, engine, args):
    from kvpress import SnapKVPress

    from kvpress_phase.evaluation.prompting import context_prefix_length
    from kvpress_phase.evaluation.tasks import score

    prefix = context_prefix_length(tokenizer)
    extra_ratios = (0.05, 0.1, 0.25)
    acc: dict = collections.defaultdict(list)
    columns = [(t, qa) for t in TASKS for qa in (False, True)]
    for task in TASKS:
        for row in rows_of(tokenizer, task, args):
            needle = (row["needle_token_start"], row["needle_token_end"])
            for qa in (False, True):
                enc = encode(engine, row, qa)
                state = engine.prefill(enc["context_ids"])
                jobs = {("no press", None): None}
                jobs.update({(f"SnapKV {r}", None): SnapKVPress(r) for r in extra_ratios})
                for r in args.ratios:
                    jobs.update({(name, r): p for name, p in screen_presses(r, needle, prefix).items()})
                outs = engine.answer_many(state, list(jobs.values()), enc["questions_ids"][0], row["max_new_tokens"])
                for key, out in zip(jobs, outs):
                    acc[(key, task, qa)].append(score(out["prediction"], row["answer"], task))
    print(f"## Screen: accuracy, {args.samples} samples per task, {args.context_length} tokens\n")
    print("query-agnostic: the question is decoded after the compressed context; query-aware: it is compressed "
          "with it.\n")
    head = " | ".join(f"{t} {'query-aware' if qa else 'query-agnostic'}" for t, qa in columns)
    print(f"| press | ratio | {head} |\n|---|---|" + "---|" * len(columns))
    for (name, ratio) in dict.fromkeys(k for k, _, _ in acc):
        cells = " | ".join(f"{sum(acc[((name, ratio), t, qa)]) / len(acc[((name, ratio), t, qa)]):.2f}"
                           for t, qa in columns)
        print(f"| {name} | {ratio if ratio is not None else ''} | {cells} |")
    print()


# ------------------------------------------------------------------------------------------------ scores
def scorers(ratio):
    from kvpress import ExpectedAttentionPress, KeyDiffPress, KnormPress, SnapKVPress, TOVAPress

    return {"SnapKV": SnapKVPress(ratio), "SnapKV window 8": SnapKVPress(ratio, window_size=8),
            "TOVA": TOVAPress(ratio), "ExpectedAttention": ExpectedAttentionPress(ratio),
            "Knorm": KnormPress(ratio), "KeyDiff": KeyDiffPress(ratio)}


def categorise(tokenizer, ids, row, prefix):
    """A category per prefill token: sink, template (the chat template's system turn), needle (the row's
    answer-bearing needle), digit (digits elsewhere, e.g. other needles' values), punctuation, word."""
    out = []
    for i, t in enumerate(ids.tolist()):
        text = tokenizer.decode([t]).strip()
        if i == 0:
            out.append("sink")
        elif i < prefix:
            out.append("template")
        elif row["needle_token_start"] <= i < row["needle_token_end"]:
            out.append("needle")
        elif text.isdigit():
            out.append("digit")
        elif text and not text.isalnum():
            out.append("punctuation")
        else:
            out.append("word")
    return out


@torch.inference_mode()
def section_scores(model, tokenizer, engine, args):
    from kvpress import SnapKVPress
    from kvpress.utils import compute_n_kept

    from kvpress_phase.evaluation.prompting import context_prefix_length

    prefix = context_prefix_length(tokenizer)
    ratios = (0.05, 0.125, 0.5)
    lost = collections.defaultdict(list)  # (name, qa, ratio) -> per row: share of (layer, head) losing an answer token
    pct = collections.defaultdict(list)   # (name, qa) -> answer tokens' mean rank percentile (0 = evicted first)
    entries = collections.defaultdict(list)  # (name, qa) -> share of the answer's (layer, head, token) entries evicted
    sink = collections.defaultdict(list)  # (name, qa) -> share of (layer, head) keeping token 0 at 12.5%
    evicted = collections.defaultdict(collections.Counter)  # (name, qa) -> categories of the 12.5% evicted first
    mass = collections.defaultdict(lambda: collections.defaultdict(list))  # qa -> region -> window attention mass
    per_layer = collections.defaultdict(list)  # (qa, layer) -> SnapKV: heads losing an answer token at 12.5%
    shown = False
    for task in TASKS:
        for row in rows_of(tokenizer, task, args):
            for qa in (False, True):
                enc = encode(engine, row, qa)
                ids = enc["context_ids"][0]
                n = len(ids)
                state = engine.prefill(enc["context_ids"])
                cats = categorise(tokenizer, ids, row, prefix)
                answer = torch.arange(row["answer_token_start"], row["answer_token_end"])
                if not shown:
                    last = "".join(tokenizer.decode([t]) for t in ids[-64:])
                    print(f"## What SnapKV's 64-query window holds\n\nquery-agnostic, {task} sample 0: the window "
                          f"is the last 64 context tokens, {last!r}; the question "
                          f"({tokenizer.decode(enc['questions_ids'][0][0])!r}) comes after it and is not scored.\n")
                    shown = True
                for name, press in scorers(0.5).items():
                    press.post_init_from_model(model)
                    losses = {r: 0 for r in ratios}
                    heads = 0
                    for layer, (module, hidden, keys, values, attentions, kwargs) in state.inputs.items():
                        scores = press.score(module, hidden, keys, values, attentions, kwargs)[0].float()
                        for h in range(scores.shape[0]):
                            order = scores[h].argsort()  # ascending: evicted first
                            rank = torch.empty(n, dtype=torch.long)
                            rank[order] = torch.arange(n)
                            for r in ratios:
                                gone = bool((rank[answer] < n - compute_n_kept(n, r)).any())
                                losses[r] += gone
                                if name == "SnapKV" and r == 0.125:
                                    per_layer[(qa, layer)].append(gone)
                            heads += 1
                            pct[(name, qa)].append((rank[answer].float() / n).mean().item())
                            n_out = n - compute_n_kept(n, 0.125)
                            entries[(name, qa)].append((rank[answer] < n_out).float().mean().item())
                            sink[(name, qa)].append(bool(rank[0] >= n_out))
                            evicted[(name, qa)].update(cats[i] for i in order[:n_out].tolist())
                    for r in ratios:
                        lost[(name, qa, r)].append(losses[r] / heads)
                for layer, (module, hidden, keys, values, attentions, kwargs) in state.inputs.items():
                    w = SnapKVPress.compute_window_attention(module, hidden, keys, 64,
                                                             kwargs["position_embeddings"])[0].mean(1).mean(0)
                    regions = {"sink (token 0)": w[:1], f"template prefix (1-{prefix - 1})": w[1:prefix],
                               "needle": w[row["needle_token_start"]:row["needle_token_end"]],
                               "64 tokens before the window": w[-64:]}
                    for region, part in regions.items():
                        mass[qa][region].append(part.sum().item())
                    mass[qa]["the window itself"].append(1 - w.sum().item())
                    mass[qa]["anything else"].append(w.sum().item() - sum(p.sum().item() for p in regions.values()))

    def mean(x):
        return sum(x) / len(x) if x else float("nan")

    n_rows = len(TASKS) * args.samples
    print(f"## What the scorers evict ({n_rows} contexts per setting, 30 layers x 3 KV heads each)\n")
    print("Lost: share of (layer, KV head) pairs in which at least one token of the answer value is among the entries "
          "evicted at that ratio. Entries: share of the answer's (layer, KV head, token) entries evicted at 12.5%. "
          "Percentile: the answer tokens' mean rank among the context's entries (0 = evicted "
          "first, 0.5 = median). Sink kept: share of (layer, KV head) pairs keeping token 0 at 12.5%.\n")
    print("| scorer | setting | lost @5% | lost @12.5% | lost @50% | entries @12.5% | answer percentile | "
          "sink kept @12.5% |")
    print("|---|---|---|---|---|---|---|---|")
    for (name, qa) in pct:
        setting = "query-aware" if qa else "query-agnostic"
        print(f"| {name} | {setting} | " + " | ".join(f"{mean(lost[(name, qa, r)]):.2f}" for r in ratios)
              + f" | {mean(entries[(name, qa)]):.2f} | {mean(pct[(name, qa)]):.2f} | {mean(sink[(name, qa)]):.2f} |")
    print("\nWhat the first 12.5% evicted are (share of the evicted entries; the context's own mix in the last row):\n")
    kinds = ("sink", "template", "needle", "digit", "punctuation", "word")
    print("| scorer | setting | " + " | ".join(kinds) + " |\n|---|---|" + "---|" * len(kinds))
    for (name, qa), counter in evicted.items():
        total = sum(counter.values())
        print(f"| {name} | {'query-aware' if qa else 'query-agnostic'} | "
              + " | ".join(f"{counter[k] / total:.3f}" for k in kinds) + " |")
    print("| (all context tokens, last sample) | | " + " | ".join(f"{cats.count(k) / len(cats):.3f}" for k in kinds)
          + " |")
    print("\nSnapKV's observation window: where its 64 queries' attention goes (mean over layers, heads, queries and "
          "contexts):\n")
    print("| region | query-agnostic | query-aware |\n|---|---|---|")
    for region in mass[False]:
        print(f"| {region} | {mean(mass[False][region]):.3f} | {mean(mass[True][region]):.3f} |")
    print("\nSnapKV, query-agnostic: share of KV heads losing an answer token at 12.5%, by layer:\n")
    layers = sorted({layer for _, layer in per_layer})
    print("| " + " | ".join(str(layer) for layer in layers) + " |\n|" + "---|" * len(layers))
    print("| " + " | ".join(f"{mean(per_layer[(False, layer)]):.2f}" for layer in layers) + " |\n")


# ------------------------------------------------------------------------------------------------ conversion
@torch.inference_mode()
def section_conversion(model, tokenizer, engine, args):
    from kvpress import SnapKVPress
    from transformers import AutoModelForCausalLM, DynamicCache

    from kvpress_phase.builtin import builtin_model_path, quiet_loading

    path = builtin_model_path("smollm2")
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        ids = tokenizer(fh.read(), return_tensors="pt", add_special_tokens=False).input_ids[:, :args.context_length]

    def loss(m):
        return m(input_ids=ids, labels=ids).loss.item()

    print(f"## The converted model\n\nrope_parameters: {model.config.rope_parameters}\n")
    print(f"Language-model loss of the first {ids.shape[1]} tokens of README.md (lower is better):\n")
    print("| model | loss |\n|---|---|")
    print(f"| as converted | {loss(model):.3f} |")
    cfg = model.config
    d = cfg.head_dim

    def to_interleaved(w, heads):  # HF's half-split rotary layout to GGUF's interleaved one
        return w.reshape(heads, 2, d // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    def from_interleaved(w, heads):
        return w.reshape(heads, d // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    saved = {k: v.clone() for k, v in model.state_dict().items() if "q_proj" in k or "k_proj" in k}
    for label, f in (("q/k rows permuted once more (to_interleaved)", to_interleaved),
                     ("q/k rows permuted back (from_interleaved)", from_interleaved)):
        for layer in model.model.layers:
            a = layer.self_attn
            a.q_proj.weight.copy_(f(a.q_proj.weight, cfg.num_attention_heads))
            a.k_proj.weight.copy_(f(a.k_proj.weight, cfg.num_key_value_heads))
        print(f"| {label} | {loss(model):.3f} |")
        model.load_state_dict(saved, strict=False)
    for theta in (10000.0, 1000000.0):
        with quiet_loading():
            other = AutoModelForCausalLM.from_pretrained(
                path, rope_parameters={"rope_theta": theta, "rope_type": "default"}).eval()
        print(f"| rope_theta {theta:g} instead of {cfg.rope_parameters['rope_theta']:g} | {loss(other):.3f} |")
        del other
    with quiet_loading():
        eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    seen = {}

    def hook(module, _, kwargs, output):
        seen[module.layer_idx] = (module, kwargs["hidden_states"], kwargs["position_embeddings"], output[1])

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in eager.model.layers]
    cache = DynamicCache()
    try:
        eager.model(input_ids=ids, past_key_values=cache, output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    worst = max((SnapKVPress.compute_window_attention(m, hs, cache.layers[i].keys, 64, pe)
                 - att[..., -64:, :-64]).abs().max().item() for i, (m, hs, pe, att) in seen.items())
    print(f"\nkvpress's SnapKVPress.compute_window_attention against the eager model's attention weights (last 64 "
          f"queries, all {len(seen)} layers): max |difference| = {worst:.2e}\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--samples", type=int, default=4, help="rows per task (default 4)")
    parser.add_argument("--context-length", type=int, default=1024)
    parser.add_argument("--ratios", default="0.125,0.5", help="the screen's ratios for every variant")
    parser.add_argument("--seed", type=int, default=10)
    args = parser.parse_args(argv)
    args.ratios = [float(r) for r in args.ratios.split(",")]
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {', '.join(sorted(unknown))}; valid: {', '.join(SECTIONS)}")
    torch.set_grad_enabled(False)
    model, tokenizer, engine = load(args)
    for name in SECTIONS:
        if name in sections:
            t = time.time()
            globals()[f"section_{name}"](model, tokenizer, engine, args)
            print(f"<!-- {name}: {time.time() - t:.0f} s -->\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
