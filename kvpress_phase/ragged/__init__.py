"""A KV cache whose heads have their own lengths, and the attention that reads it.

- :mod:`.cache`: :class:`RaggedLayer` (one layer, every KV head head-flattened at its own length, grown in place while
  decoding), :class:`RaggedCache` (a transformers ``Cache`` of them), :func:`cache_bytes` (the bytes any cache holds);
- :mod:`.attention`: :func:`ragged_attention_forward`, registered with transformers' ``AttentionInterface`` as
  ``"kvpress_phase_ragged"`` when this package is imported (SDPA, exactly, for layers that are not ragged).

The attention itself is :func:`kvpress_phase.kernels.ragged_attention` (Triton on a GPU, PyTorch elsewhere).

    from kvpress_phase.ragged import ATTENTION_NAME, RaggedCache, RaggedLayer
    cache = RaggedCache([RaggedLayer.from_dense(k, v, lengths=kept) for k, v, kept in layers])
    model.set_attn_implementation(ATTENTION_NAME)
"""

from kvpress_phase.ragged.attention import ragged_attention_forward, register
from kvpress_phase.ragged.cache import ATTENTION_NAME, RaggedCache, RaggedLayer, RaggedView, cache_bytes, cache_nbytes

register()

__all__ = ["ATTENTION_NAME", "RaggedCache", "RaggedLayer", "RaggedView", "cache_bytes", "cache_nbytes", "ragged_attention_forward",
           "register"]
