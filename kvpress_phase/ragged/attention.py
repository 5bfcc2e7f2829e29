"""The attention that reads ragged layers, registered with transformers as ``"kvpress_phase_ragged"``.

:func:`ragged_attention_forward` is an attention function of transformers' ``AttentionInterface``: a model run with
``attn_implementation="kvpress_phase_ragged"`` (or ``model.set_attn_implementation("kvpress_phase_ragged")``) calls it
in every attention layer. Where the layer's cache is a :class:`~kvpress_phase.ragged.cache.RaggedLayer` (its keys
arrive as a :class:`~kvpress_phase.ragged.cache.RaggedView`), it attends over each KV head's own entries through
:func:`kvpress_phase.kernels.ragged_attention` (the package's one dispatch point: the Triton varlen decoding kernel
on a GPU, the PyTorch reference elsewhere), causal within the step's new tokens and every cached entry visible; the
model's attention mask is not read there (batch 1, unpadded). Everywhere else (dense layers, the prefill) it calls
the registered ``"sdpa"`` function with the same arguments, so a model without ragged layers behaves exactly as
with ``attn_implementation="sdpa"``; the mask function registered under the same name is transformers' SDPA mask.

Registration (:func:`register`) runs when :mod:`kvpress_phase.ragged` is imported; no model method is patched.
"""

from __future__ import annotations

import torch

from kvpress_phase.ragged.cache import ATTENTION_NAME, RaggedView

__all__ = ["ragged_attention_forward", "register", "ATTENTION_NAME"]


def ragged_attention_forward(module, query: torch.Tensor, key, value, attention_mask, *args, **kwargs):
    """transformers' attention-function signature: ``query`` is ``(batch, q_heads, n_new, head_dim)``; returns
    ``(attn_output (batch, n_new, q_heads, value_dim), None)`` as SDPA's function does."""
    if not isinstance(key, RaggedView):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, *args, **kwargs)
    from kvpress_phase.kernels import ragged_attention

    if query.shape[0] != 1:
        raise ValueError(f"query: attention over a ragged cache takes batch 1, got batch {query.shape[0]}")
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = getattr(module, "scaling", None)
    out = ragged_attention(query[0].to(key.dtype), key.buffer, value.buffer, key.starts, key.lengths,
                           scaling=scaling, check_index=False)  # RaggedLayer keeps its index inside its buffers
    return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None


# kvpress_phase.presses.uneven_layers wraps every registered attention function to align masks of the wrong length;
# this one aligns nothing itself and delegates dense layers to the (wrapped) "sdpa", so it is marked as handled.
ragged_attention_forward._kvpress_phase_aligned = True


def register() -> None:
    """Register :func:`ragged_attention_forward` and transformers' SDPA mask under ``"kvpress_phase_ragged"``
    (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, ragged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
