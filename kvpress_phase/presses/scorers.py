"""Scorers our presses use where kvpress's own need a fix, and KVzip's reconstruction scores as a scorer.

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

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch
from kvpress import ExpectedAttentionPress, KeyDiffPress, KnormPress, RandomPress, ScorerPress, SnapKVPress, TOVAPress
from kvpress.utils import get_prerope_query_states

from kvpress_phase.presses.kvzip_adapter import kvzip_scores
from kvpress_phase.presses.learned_scorer import LocalKVzapMLPPress, LocalKVzapPress
from torch import nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import rotate_half


@dataclass
class SnapKVScorer(SnapKVPress):
    """kvpress's SnapKV scores, with queries rotated over the rotary dimensions only (see the module docstring).

    Parameters are SnapKVPress's: ``compression_ratio`` (unused when it serves as a scorer), ``window_size``
    (default 64: the last context tokens whose attention is averaged) and ``kernel_size`` (default 5: the
    average pooling of the scores along the sequence). A context no longer than ``window_size`` tokens (where
    kvpress refuses) is scored with the attention of its second half.
    """

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        n = hidden_states.shape[1]
        if n < 2:
            return keys.new_zeros(keys.shape[:3], dtype=torch.float32)
        window = self.window_size if n > self.window_size else n // 2
        training = torch.is_grad_enabled() and (hidden_states.requires_grad or keys.requires_grad)
        if attentions is not None or training:
            # kvpress's computation: on the model's own attention weights (eager attention), or differentiable
            # (window_scores works in place)
            return SnapKVPress.score(dataclasses.replace(self, window_size=window), module, hidden_states, keys,
                                     values, attentions, kwargs)
        scores = self.window_scores(module, hidden_states, keys, window, kwargs["position_embeddings"])
        scores = F.avg_pool1d(scores, kernel_size=self.kernel_size, padding=self.kernel_size // 2, stride=1)
        return F.pad(scores, (0, window), value=scores.max().item() + 1)  # the window itself is never dropped

    @staticmethod
    def window_scores(module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, window_size: int,
                      position_embeddings) -> torch.Tensor:
        """SnapKV's scores before smoothing, ``(batch, kv_heads, seq_len - window_size)`` float32: the attention
        of the last ``window_size`` queries to each earlier key, averaged over the window and over the query heads
        of each KV head.

        The same figures as kvpress's ``compute_window_attention`` followed by its means, computed one KV head at
        a time: the head's attention logits are exponentiated in place and reduced by one matrix-vector product
        with the reciprocal softmax denominators, so no normalised copy of the weights is made and the temporary
        is one head's ``(seq_len, groups * window_size)`` logits instead of every head's. Averaging over the query
        heads before kvpress's smoothing gives the same scores, since the smoothing is linear and the same per head.
        Not differentiable (``score`` uses kvpress's computation when gradients are needed)."""
        batch, kv_heads, k_len, head_dim = keys.shape
        groups = module.config.num_attention_heads // kv_heads
        query = _rotated_queries(module, hidden_states[:, -window_size:], position_embeddings, window_size)
        query = query.reshape(batch, kv_heads, groups * window_size, head_dim) * (1.0 / math.sqrt(module.head_dim))
        # the causal mask of the window, transposed (keys along the rows), for each query head of the KV head
        causal = torch.tril(torch.full((window_size, window_size), float("-inf"), device=keys.device), diagonal=-1)
        causal = causal.unsqueeze(1)
        out = torch.empty(batch, kv_heads, k_len - window_size, dtype=torch.float32, device=keys.device)
        for b in range(batch):
            for h in range(kv_heads):
                # (k_len, groups * window): keys along the rows, so every reduction below is over contiguous rows
                logits = torch.matmul(keys[b, h], query[b, h].transpose(0, 1)).float()
                logits[-window_size:].view(window_size, groups, window_size).add_(causal)
                weights = logits.sub_(logits.amax(dim=0)).exp_()
                norm = weights.sum(dim=0).reciprocal_().mul_(1.0 / (groups * window_size))
                torch.mv(weights[:-window_size], norm, out=out[b, h])
        return out

    @staticmethod
    def compute_window_attention(module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, window_size: int,
                                 position_embeddings) -> torch.Tensor:
        """Attention of the last ``window_size`` queries to the keys before them, ``(batch, query heads,
        window_size, seq_len - window_size)``: kvpress's computation with the query heads of one KV head stacked
        against that head's keys (no copy of the keys per query head) and the causal mask on the window alone."""
        batch, kv_heads, k_len, head_dim = keys.shape
        groups = module.config.num_attention_heads // kv_heads
        query = _rotated_queries(module, hidden_states[:, -window_size:], position_embeddings, window_size)
        query = query.reshape(batch, kv_heads, groups * window_size, head_dim)
        weights = torch.matmul(query, keys.transpose(2, 3)) / math.sqrt(module.head_dim)
        window = weights.view(batch, kv_heads, groups, window_size, k_len)[..., -window_size:]
        window.add_(torch.triu(torch.full((window_size, window_size), float("-inf"), device=keys.device), diagonal=1))
        weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        return weights.view(batch, kv_heads * groups, window_size, k_len)[..., :-window_size]

    @staticmethod
    def decoding_scores(module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor,
                        position_embeddings) -> torch.Tensor:
        """Scores of ``keys`` (a block of the cache, already rotated) while decoding, ``(batch, kv_heads, k_len)``:
        the attention of the current step's query (the last of ``hidden_states``) restricted to those keys,
        averaged over each KV head's query heads. While decoding (:class:`~kvpress_phase.WindowedDecodingPress`) there is no window of
        context queries;
        this is SnapKV's signal with the newest token as its one-query window."""
        batch, kv_heads, k_len, head_dim = keys.shape
        groups = module.config.num_attention_heads // kv_heads
        query = _rotated_queries(module, hidden_states[:, -1:], position_embeddings, 1)
        query = query.reshape(batch, kv_heads, groups, head_dim)
        weights = torch.matmul(query, keys.transpose(2, 3)) / math.sqrt(module.head_dim)
        return nn.functional.softmax(weights, dim=-1, dtype=torch.float32).mean(dim=2)


def _rotated_queries(module: nn.Module, hidden_states: torch.Tensor, position_embeddings, n: int) -> torch.Tensor:
    """The last ``n`` tokens' queries, ``(batch, query heads, n, head_dim)``, rotated over the rotary dimensions
    only."""
    query = get_prerope_query_states(module, hidden_states)
    cos, sin = position_embeddings
    cos, sin = cos[:, -n:].unsqueeze(1), sin[:, -n:].unsqueeze(1)
    rotary = cos.shape[-1]
    q_rot, q_pass = query[..., :rotary], query[..., rotary:]
    return torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), dim=-1)


@dataclass
class KVzipScorer(ScorerPress):
    """KVzip's query-agnostic importance scores as a scorer for our presses (``scorer=KVzipScorer()``).

    KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction"; kvpress's
    ``KVzipPress``) scores every cache entry by the largest attention it receives while the model, prompted to
    "repeat the previous context", reconstructs the context over its own cache. The scores need the whole prefilled
    context, so a press with this scorer does not compress during the prefill: it records each layer's inputs,
    lets the prefill finish, computes the scores (:meth:`compute`: kvpress's own ``KVzipPress`` code, driven by
    :mod:`~kvpress_phase.presses.kvzip_adapter`; about twice the prefill's compute) and then compresses every
    layer's cache (``WindowedPress.__call__``). The cache is really shortened, with our presses' exact length rule
    (kvpress's ``KVzipPress`` keeps every entry and masks the evicted ones).

    Parameters
    ----------
    chunk_size : int, default 2048
        Context tokens reconstructed by each replay pass (KVzipPress's ``chunk_size``).
    kvzip_plus_normalization : bool, default False
        KVzip+'s scores: the attention scaled by the norm of the value's output projection over the query's
        hidden-state norm (kvpress's option of the same name).
    tokenizer : optional
        The model's tokenizer, for the reconstruction prompt; None loads it from ``model.config.name_or_path`` as
        kvpress's ``KVzipPress`` does.
    """

    compression_ratio: float = 0.0
    chunk_size: int = 2048
    kvzip_plus_normalization: bool = False
    tokenizer: Optional[object] = field(default=None, repr=False, compare=False)
    scores: Optional[torch.Tensor] = field(default=None, init=False, repr=False, compare=False)
    """``(layers, batch, kv_heads, context_length)``: the scores of the last context (:meth:`compute`)."""
    needs_context: ClassVar[bool] = True

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.scores is None:
            raise ValueError("KVzipScorer's scores come from reconstructing the whole context after the prefill: use "
                             "the press as a context manager (`with press(model): ...` or kvpress's pipeline)")
        n = keys.shape[2]
        scores = self.scores[module.layer_idx]
        if scores.shape[-1] != n:
            raise ValueError(f"KVzipScorer holds scores of {scores.shape[-1]} tokens, the layer has {n}")
        return scores.to(device=keys.device, dtype=torch.float32)

    def compute(self, model, context_ids: torch.Tensor, cache, tokenizer=None) -> torch.Tensor:
        """Score the prefilled context ``context_ids`` (its full cache ``cache``, not modified) with kvpress's
        ``KVzipPress`` (:func:`~kvpress_phase.presses.kvzip_adapter.kvzip_scores`). Stores and returns the
        scores."""
        self.scores = kvzip_scores(model, context_ids, cache, tokenizer or self.tokenizer,
                                   plus=self.kvzip_plus_normalization, chunk_size=self.chunk_size)
        return self.scores


@dataclass
class KeyDiffScorer(KeyDiffPress):
    """kvpress's KeyDiff scores (minus the cosine similarity of each key to the mean of the normalised keys),
    computed without kvpress's normalised copy of every key: one pass for the key norms, one matrix-vector product
    for the anchor (the mean normalised key) and one for the similarities, in float32. Equal to
    ``KeyDiffPress.score`` up to float rounding (``tests/presses/test_scorers.py``); the presses' default scorer and
    the name ``keydiff``. kvpress's own ``KeyDiffPress()`` passed as a scorer is asked through its own ``score``."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        x = keys if keys.dtype == torch.float32 else keys.float()
        norms = torch.linalg.vector_norm(x, dim=-1)                                   # (B, H, n)
        anchor = torch.einsum("bhnd,bhn->bhd", x, 1.0 / norms.clamp_min(1e-12)) / x.shape[2]
        dots = torch.einsum("bhnd,bhd->bhn", x, anchor)
        scale = norms.clamp_min(1e-8) * torch.linalg.vector_norm(anchor, dim=-1, keepdim=True).clamp_min(1e-8)
        return -dots / scale


@dataclass
class RankMixScorer(ScorerPress):
    """Two scorers' orders mixed within each layer, on the first scorer's scale.

    Within a layer (every KV head and token of a batch row together), each scorer's scores become ranks in [0, 1);
    the mix is ``(1 - weight) * rank(first) + weight * rank(second)``; the entry ranked ``i``-th by the mix gets the
    ``i``-th smallest of ``first``'s scores. So the layer's scores keep ``first``'s distribution (a budget across
    layers, :class:`~kvpress_phase.presses.budget.GlobalBudgetPress`, spreads as it does over ``first`` alone),
    while the order within the layer follows the mix. ``weight=0`` is ``first``'s order, ``weight=1`` ``second``'s.
    The scorer names ``kvzap_keydiff_25``, ``_50`` and ``_75`` are the learned scores (``first``) mixed with
    KeyDiff's (``second``) at weight 0.25, 0.5 and 0.75 (docs/preregistration-low-ratio.md)."""

    first: Optional[ScorerPress] = None
    second: Optional[ScorerPress] = None
    weight: float = 0.5

    def __post_init__(self):
        for name in ("first", "second"):
            if not isinstance(getattr(self, name), ScorerPress):
                raise ValueError(f"RankMixScorer: {name} must be a kvpress ScorerPress, got "
                                 f"{type(getattr(self, name)).__name__}")
        if not 0.0 <= float(self.weight) <= 1.0:
            raise ValueError(f"RankMixScorer: weight must be in [0, 1], got {self.weight}")

    def post_init_from_model(self, model):
        self.first.post_init_from_model(model)
        self.second.post_init_from_model(model)

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        first = token_scores(self.first, module, hidden_states, keys, values, attentions, kwargs)
        second = token_scores(self.second, module, hidden_states, keys, values, attentions, kwargs)
        flat_first, flat_second = first.reshape(first.shape[0], -1), second.reshape(second.shape[0], -1)
        n = flat_first.shape[1]

        def ranks(x):
            return x.argsort(dim=1, stable=True).argsort(dim=1, stable=True).float() / n

        mix = (1.0 - self.weight) * ranks(flat_first) + self.weight * ranks(flat_second)
        order = mix.argsort(dim=1, stable=True).argsort(dim=1, stable=True)
        return flat_first.sort(dim=1).values.gather(1, order).reshape(first.shape)


def _kvzap_keydiff(weight: float):
    def build() -> RankMixScorer:
        return RankMixScorer(first=LocalKVzapPress(), second=KeyDiffScorer(), weight=weight)
    build.__name__ = f"kvzap_keydiff_{round(weight * 100)}"
    return build


SCORERS = {
    "knorm": KnormPress,
    "snapkv": SnapKVScorer,
    "expected_attention": ExpectedAttentionPress,
    "tova": TOVAPress,
    "keydiff": KeyDiffScorer,
    "random": RandomPress,
    "kvzip": KVzipScorer,
    "kvzap": LocalKVzapPress,
    "kvzap_mlp": LocalKVzapMLPPress,
    "kvzap_keydiff_25": _kvzap_keydiff(0.25),
    "kvzap_keydiff_50": _kvzap_keydiff(0.5),
    "kvzap_keydiff_75": _kvzap_keydiff(0.75),
}
"""Scorers our presses accept by name, in Python (``PhaseAwarePress(scorer="keydiff")``) and in an evaluation press
spec (``phase_aware:scorer=snapkv``): kvpress's, for ``snapkv`` its partial-rotary-safe version
:class:`SnapKVScorer` (same scores otherwise), for ``keydiff`` :class:`KeyDiffScorer` (same scores, no copy of
the keys), and for ``kvzap`` kvpress's ``KVzapPress`` with the scorer shipped for
the model (:class:`~kvpress_phase.presses.learned_scorer.LocalKVzapPress`: learned KVzip+ scores, comparable
across layers), for ``kvzap_mlp`` the two-layer MLP scorer shipped beside it, and for ``kvzap_keydiff_W`` the learned
scores' order mixed with KeyDiff's at weight W/100 (:class:`RankMixScorer`)."""


BASELINE_SCORERS = {**SCORERS, "keydiff": KeyDiffPress}
"""The scorers kvpress's own wrappers take by name in an evaluation spec (``adakv:scorer=NAME``,
``chunk:scorer=NAME``): :data:`SCORERS`, with kvpress's ``KeyDiffPress`` itself for ``keydiff``, so that a kvpress
baseline runs kvpress's code."""


def scorer_from_name(name: str, table: dict = SCORERS) -> ScorerPress:
    """A fresh scorer for a name of ``table`` (:data:`SCORERS`, or :data:`BASELINE_SCORERS` for kvpress's
    wrappers); ValueError listing the names otherwise."""
    if name not in table:
        raise ValueError(f"unknown scorer {name!r}; valid scorers: {', '.join(table)}")
    return table[name]()


def token_scores(scorer: ScorerPress, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
    """``scorer.score(...)`` in float32: every scorer, ours or kvpress's, is asked through its own ``score``."""
    return scorer.score(module, hidden_states, keys, values, attentions, kwargs).float()
