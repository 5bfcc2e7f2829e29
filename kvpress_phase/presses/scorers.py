"""Scorers our presses use by default, where kvpress's own need a fix.

:class:`SnapKVScorer` is kvpress's :class:`~kvpress.SnapKVPress` (the attention that the context's last
``window_size`` queries pay to every key, averaged over the query heads of each KV head and smoothed) with one
change: the queries are rotated with only as many dimensions as the model's rotary embedding has. kvpress rotates
the whole head, which fails on partial-rotary models (Phi-3 style ``partial_rotary_factor < 1``); where the rotary
embedding covers the whole head the two give the same scores (``tests/presses/test_scorers.py``).

What a scorer can see: kvpress compresses the context before the question is appended, so a "query-aware" score
is aware of the context's own last tokens, not of the question. SnapKV's observation window is the last 64
context tokens; a question that the context ends with, or a context whose end resembles the question, steers it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from kvpress import SnapKVPress
from kvpress.utils import get_prerope_query_states
from torch import nn
from transformers.models.llama.modeling_llama import repeat_kv, rotate_half


@dataclass
class SnapKVScorer(SnapKVPress):
    """kvpress's SnapKV scores, with queries rotated over the rotary dimensions only (see the module docstring).

    Parameters are SnapKVPress's: ``compression_ratio`` (unused when it serves as a scorer), ``window_size``
    (default 64: the last context tokens whose attention is averaged) and ``kernel_size`` (default 5: the
    average pooling of the scores along the sequence).
    """

    @staticmethod
    def compute_window_attention(module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, window_size: int,
                                 position_embeddings) -> torch.Tensor:
        _, _, k_len, _ = keys.shape
        groups = module.config.num_attention_heads // module.config.num_key_value_heads
        query = get_prerope_query_states(module, hidden_states[:, -window_size:])
        cos, sin = position_embeddings
        cos, sin = cos[:, -window_size:].unsqueeze(1), sin[:, -window_size:].unsqueeze(1)
        rotary = cos.shape[-1]
        q_rot, q_pass = query[..., :rotary], query[..., rotary:]
        query = torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), dim=-1)
        weights = torch.matmul(query, repeat_kv(keys, groups).transpose(2, 3)) / math.sqrt(module.head_dim)
        mask = torch.triu(torch.full_like(weights, float("-inf")), diagonal=k_len - window_size + 1)
        weights = nn.functional.softmax(weights + mask, dim=-1, dtype=torch.float32).to(query.dtype)
        return weights[..., :-window_size]
