"""Tiny random-weight models of every family kvpress supports, and a tiny tokenizer, built offline."""

from __future__ import annotations

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")

HEAD_DIM = 8
"""The head size of :class:`FakeAttention`."""
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))


class FakeAttention(torch.nn.Module):
    """The attributes a press reads from an attention layer, with a real RoPE inverse-frequency table (a press
    called directly on keys and values, without a model)."""

    def __init__(self, layer_idx=0):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = HEAD_DIM
        self.rotary_emb = torch.nn.Module()
        self.rotary_emb.register_buffer("inv_freq", INV_FREQ)


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


CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character that stands for each of the 256 bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tiny_gguf(path: str, *, seed: int = 0, pre: str = "smollm", eos_id: int = 1, bos_id: int = 1,
                    tie: bool = False, chat_template: str = CHATML_TEMPLATE):
    """Write a tiny Llama with a byte-level BPE vocabulary (ChatML specials first, the 256 byte tokens, a few merges)
    to a float32 GGUF file the way llama.cpp's converter lays one out (q and k rows permuted for its RoPE). Returns
    the source ``LlamaForCausalLM``. ``eos_id`` 1 (``<|im_start|>``) repeats the SmolLM2 file's wrong EOS; ``bos_id``
    0 (``<|endoftext|>``) repeats the Qwen2 files' BOS, which nothing prepends."""
    import gguf
    import numpy as np
    import transformers as tf

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ w", "Ġ s", "r e"]
    tokens = specials + _byte_chars() + ["".join(m.split(" ")) for m in merges]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    config = tf.LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1,
                            eos_token_id=2)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a wrong mapping of them shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(bos_id)
    writer.add_eos_token_id(eos_id)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)

    def permute(w, n_head):  # llama.cpp's layout of q and k rows
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(config.num_hidden_layers):
        for hf, gg in names.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                w = permute(w, config.num_attention_heads)
            elif gg == "attn_k":
                w = permute(w, config.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(w))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not tie:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def tiny_scorer(model, path, *, layers=None, favour=None) -> str:
    """A linear KVzap scorer written to the folder ``path`` for ``model``'s shape (``layers`` to get it wrong); with
    ``favour``, every score of that layer is 10 higher (a constant bias) and the others 10 lower. Returns the
    folder."""
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

    c = model.config
    n = layers or c.num_hidden_layers
    config = KVzapConfig(input_dim=c.hidden_size, output_dim=c.num_key_value_heads, n_modules=n,
                         source_num_hidden_layers=n, source_hidden_size=c.hidden_size,
                         source_num_key_value_heads=c.num_key_value_heads, source_model="tiny")
    torch.manual_seed(0)
    scorer = KVzapModel(config)
    if favour is not None:
        with torch.no_grad():
            for i, layer in enumerate(scorer.layers):
                layer.weight.mul_(0.01)
                layer.bias.fill_(10.0 if i == favour else -10.0)
    scorer.save_pretrained(path)
    return str(path)


def assert_replay_matches_pipeline(model, tokenizer, make_press, *, check=None, attention: str | None = None,
                                   pipeline_attention: str | None = None):
    """Answer two ``niah_single`` rows (200 tokens, phases 1 and 6, 6 new tokens) both through the replay engine and
    through kvpress's pipeline, each with a fresh press from ``make_press()``, and assert that the answers agree.
    With ``attention``, the model is set back to that attention implementation after each pipeline call (a press
    that stores its cache ragged switches it); ``check(engine, state, replayed, press)`` then runs on each row, with
    the press that the pipeline used."""
    from transformers import DynamicCache, pipeline

    from kvpress_phase.evaluation.replay import ReplayEngine
    from kvpress_phase.evaluation.tasks import generate

    rows = generate("niah_single", tokenizer, n_samples=2, context_length=200, stride=8, phases=[1, 6],
                    protocol="offset", seed=5)
    engine = ReplayEngine(model, tokenizer, step_by_step=True)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    for row in rows:
        encoded = engine.encode(row["context"], [row["question"]], row["answer_prefix"])
        state = engine.prefill(encoded["context_ids"])
        replayed = engine.answer_many(state, [make_press()], encoded["questions_ids"][0], 6, batch_size=1)[0]
        press = make_press()
        if pipeline_attention is not None:
            model.set_attn_implementation(pipeline_attention)
        direct = pipe(row["context"], question=row["question"], answer_prefix=row["answer_prefix"], press=press,
                      max_new_tokens=6, cache=DynamicCache())["answer"]
        if attention is not None:
            model.set_attn_implementation(attention)
        assert replayed["prediction"] == direct
        if check is not None:
            check(engine, state, replayed, press)
