"""A first look at chunked-stride compression: run the kvpress pipeline with and without the presses.

    python -m kvpress_phase.evaluation.quickstart

Builds a small random-weight Llama and a word-level tokenizer offline (nothing is downloaded), prefills one
context through ``pipeline("kv-press-text-generation", ...)`` with no press, with ``ChunkedStridePress`` and with
``PhaseAwarePress``, and prints each cache's length and the phases of the entries each press kept in layer 0.
A random model answers nonsense; the point here is the mechanics (the built-in trained model is used by the
phase evaluation).
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch


def build_demo_model(seed: int = 0):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<pad>", "<bos>", "<eos>", "<unk>", "\n"] + [f"w{i}" for i in range(251)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="removed")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>")
    config = LlamaConfig(vocab_size=len(words), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval(), tokenizer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-length", type=int, default=400, help="words in the context")
    parser.add_argument("--compression-ratio", type=float, default=0.5)
    parser.add_argument("--stride", type=int, default=8)
    args = parser.parse_args(argv)

    from kvpress import KnormPress
    from transformers import DynamicCache, pipeline

    from kvpress_phase import ChunkedStridePress, PhaseAwarePress

    model, tokenizer = build_demo_model()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    rng = torch.Generator().manual_seed(0)
    context = " ".join(f"w{int(i)}" for i in torch.randint(0, 251, (args.context_length,), generator=rng))
    r, S = args.compression_ratio, args.stride
    presses = {
        "no press": None,
        "kvpress KnormPress": KnormPress(r),
        "ChunkedStridePress(select)": ChunkedStridePress(r, stride=S, window=S, mode="select"),
        "ChunkedStridePress(pool)": ChunkedStridePress(r, stride=S, window=S, mode="pool"),
        "PhaseAwarePress": PhaseAwarePress(r, stride=S),
    }
    print(f"context: {args.context_length} words + BOS, compression_ratio={r}, stride={S}\n")
    for name, press in presses.items():
        cache = DynamicCache()
        answer = pipe(context, question="w1 w2 w3", press=press, max_new_tokens=5, cache=cache)["answer"]
        line = f"{name:<28} cache length {cache.layers[0].keys.shape[2]:>4}  answer {answer!r}"
        stats = getattr(press, "stats", {}).get(0)
        if stats is not None and stats.phases is not None:
            counts = Counter(stats.phases[0, 0].tolist())
            line += "  kept phases (head 0): " + " ".join(f"{p}:{counts[p]}" for p in range(S))
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
