"""Tiny random-weight models of every family kvpress supports, and a tiny tokenizer, built offline."""

from __future__ import annotations

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")


def tiny_model(family: str, *, num_key_value_heads: int = 2, num_attention_heads: int = 4, head_dim: int = 16,
               dtype: torch.dtype = torch.float32, seed: int = 0, vocab_size: int = 64, num_hidden_layers: int = 2):
    """A 2-layer random-weight causal LM of ``family`` with grouped-query attention."""
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=num_attention_heads * head_dim,
        intermediate_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":
        config, cls = tf.LlamaConfig(**common, head_dim=head_dim), tf.LlamaForCausalLM
    elif family == "mistral":
        config, cls = tf.MistralConfig(**common, head_dim=head_dim, sliding_window=None), tf.MistralForCausalLM
    elif family == "qwen2":
        config, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif family == "qwen3":
        config, cls = tf.Qwen3Config(**common, head_dim=head_dim), tf.Qwen3ForCausalLM
    elif family == "phi3":
        config = tf.Phi3Config(**common)
        config.rope_parameters["partial_rotary_factor"] = 0.5
        cls = tf.Phi3ForCausalLM
    elif family == "gemma3":
        config = tf.Gemma3TextConfig(**common, head_dim=head_dim, sliding_window=32,
                                     layer_types=["sliding_attention", "full_attention"][:num_hidden_layers])
        cls = tf.Gemma3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(config).to(dtype).eval()
    return model


def tiny_tokenizer(vocab_size: int = 64):
    """A word-level tokenizer over ``w0 .. w{n}`` plus specials, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for i in range(vocab_size - len(specials) - 1):
        vocab[f"w{i}"] = len(vocab)
    vocab["\n"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="removed")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
