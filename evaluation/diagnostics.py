"""A diagnostic that needs no generation: how much attention the needle keeps after compression.

For one prefilled context and one press, the question is run once over the compressed cache with eager
attention, and the attention of the question's last token (the one that predicts the first answer token) is
summed over the cache entries whose source tokens overlap the needle's token span. The same sum over the full
cache is the reference; their ratio, averaged over layers and heads, is ``needle_attention_ratio``: 1 means the
needle draws as much attention as without compression, 0 means none.

Which source tokens an entry covers comes from ``press.stats`` for this package's presses (a pooled entry covers
its group), from the identity for an uncompressed layer, and, for presses that keep a subset of the original
entries (the kvpress scorer presses), from matching every kept key against the original keys.

The runner does not run the question a second time for this: :class:`AttentionProbe` hooks the attention layers
during the first decoding step of the answer (the question's forward over the compressed cache) and computes the
last token's attention row there, as eager attention would (``softmax(q k^T * scaling)`` in float32, cast to the
model's dtype), from that layer's input and its cache. :func:`needle_mass` turns the rows into the diagnostic.
:func:`needle_attention` is the stand-alone version that runs the question once more with eager attention; the two
agree to float rounding (the layers' inputs come from the model's own attention kernel in the first, from eager
attention in the second; ``tests/evaluation/test_runner.py`` checks the agreement).
"""

from __future__ import annotations

import torch


def _key_hash(keys: torch.Tensor) -> torch.Tensor:
    r = torch.randn(keys.shape[-1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return keys.double() @ r.to(keys.device)


def _match_kept(original: torch.Tensor, kept: torch.Tensor, index=None) -> torch.Tensor:
    """Source index of every kept key (``-1`` if it is no original key), by exact match of a random projection.

    ``index`` is ``(order, sorted_hashes)`` of ``original`` when already computed (it depends only on the original
    keys, so the runner computes it once per prefilled layer).
    """
    order, sorted_h = index if index is not None else _sorted_key_hashes(original)
    order, sorted_h = order.to(kept.device), sorted_h.to(kept.device)
    h_kept = _key_hash(kept)
    pos = torch.searchsorted(sorted_h, h_kept.contiguous()).clamp(max=sorted_h.shape[-1] - 1)
    idx = order.gather(-1, pos)
    found = sorted_h.gather(-1, pos) == h_kept
    return torch.where(found, idx, torch.full_like(idx, -1))


def _sorted_key_hashes(original: torch.Tensor):
    h_orig = _key_hash(original)
    order = h_orig.argsort(dim=-1)
    return order, h_orig.gather(-1, order)


def entry_spans(press, layer_idx: int, original_keys: torch.Tensor, kept_keys: torch.Tensor, memo=None):
    """``(start, end)`` tensors ``(batch, heads, entries)``: the source tokens each cache entry covers.

    ``memo`` (a dict kept with the prefilled context) caches the sorted hashes of the original keys per layer.
    """
    stats = getattr(press, "stats", {}).get(layer_idx) if press is not None else None
    if stats is not None and stats.positions is not None:
        return stats.positions.long().to(kept_keys.device), stats.ends.long().to(kept_keys.device)
    n = kept_keys.shape[2]
    if n == original_keys.shape[2] and (press is None or torch.equal(kept_keys, original_keys.to(kept_keys.device))):
        start = torch.arange(n, device=kept_keys.device).expand(kept_keys.shape[:3])
        return start, start + 1
    index = None
    if memo is not None:
        key = ("sorted_key_hashes", layer_idx)
        if key not in memo:
            memo[key] = _sorted_key_hashes(original_keys)
        index = memo[key]
    start = _match_kept(original_keys, kept_keys, index)
    return start, torch.where(start >= 0, start + 1, start)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as the supported models apply it (``x * cos + rotate_half(x) * sin``, on the first ``cos.shape[-1]``
    dims for partial rotary), for ``x`` of shape ``(batch, heads, seq, head_dim)`` and ``cos``/``sin`` of shape
    ``(batch, seq, rot_dim)``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated * sin
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


class AttentionProbe:
    """Context manager: during the next forward, store each recorded layer's last-token attention row.

    ``layers`` maps layer index to a tuple whose first item is the layer's attention module (``Prefill.inputs``).
    ``rows[layer_idx]`` receives a ``(batch, heads, cache_entries + query_len)`` tensor: the attention weights of
    the forward's last query token over the layer's whole cache, computed as eager attention computes them. Only
    the first forward after entering is recorded (the question's, when it wraps ``generate_answer``). When that
    forward feeds ``trailing`` tokens after the question (a draft checked with the question,
    :func:`.decoding.decode_tokens`), the row is the question's last token's, over the entries it attends to.
    """

    trailing = 0

    def __init__(self, model, layers: dict, rows: dict):
        self.model = model
        self.modules = {idx: entry[0] for idx, entry in layers.items()}
        self.rows = rows
        self._hooks = []

    def __enter__(self):
        for module in self.modules.values():
            self._hooks.append(module.register_forward_hook(self._hook, with_kwargs=True))
        return self.rows

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        return False

    def _hook(self, module, args, kwargs, output):
        from kvpress.utils import get_prerope_query_states

        layer_idx = module.layer_idx
        if layer_idx in self.rows:  # a later forward
            return
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        last = hidden.shape[1] - 1 - self.trailing  # the question's last token in this forward
        at = slice(last, last + 1)
        query = _rotate(get_prerope_query_states(module, hidden[:, at]), cos[:, at], sin[:, at])
        keys = kwargs["past_key_values"].layers[layer_idx].keys  # the cache after this step's update
        keys = keys[:, :, : keys.shape[2] - self.trailing]
        batch, heads, _, dim = query.shape
        kv_heads = keys.shape[1]
        # query heads grouped by the KV head they share, instead of repeating the keys for every query head
        grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
        logits = torch.matmul(grouped, keys.transpose(2, 3)).reshape(batch, heads, -1) * module.scaling
        softcap = getattr(module.config, "attn_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:  # masked entries (decoding.LayerMasks), padding
            row = mask[:, :, last, : mask.shape[-1] - self.trailing][..., -logits.shape[-1]:].expand(batch, heads, -1)
            logits = logits.masked_fill(~row, float("-inf")) if row.dtype == torch.bool else logits + row
        self.rows[layer_idx] = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
        if all(idx in self.rows for idx in self.modules):  # done: the decoding steps run without hooks
            self.__exit__()


def needle_mass(rows: dict, state, press, cache, needle: tuple[int, int], query_len: int) -> float:
    """Mean over layers and heads of the attention mass that ``rows`` (from :class:`AttentionProbe`) put on the
    cache entries covering the needle's tokens ``[needle[0], needle[1])``."""
    lo, hi = needle
    masses = []
    for layer_idx in sorted(rows):
        row = rows[layer_idx]
        keys = state.inputs[layer_idx][2]
        n_entries = row.shape[-1] - query_len
        kept = cache.layers[layer_idx].keys[:, :, :n_entries]
        start, end = entry_spans(press, layer_idx, keys, kept, memo=getattr(state, "memo", None))
        covers = (start < hi) & (end > lo) & (start >= 0)  # (batch, kv_heads, entries)
        batch, heads, _ = row.shape
        grouped = row[:, :, :n_entries].unflatten(1, (covers.shape[1], heads // covers.shape[1]))
        masses.append(float((grouped * covers[:, :, None]).sum(-1).mean()))
    return sum(masses) / max(1, len(masses))


@torch.no_grad()
def needle_attention(engine, state, press, question_ids: torch.Tensor, needle: tuple[int, int],
                     cache=None) -> float:
    """Mean over layers and heads of the last question token's attention mass on the needle's entries."""
    model = engine.model
    cache = cache if cache is not None else engine.compressed_cache(state, press)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        positions = torch.arange(state.context_length, state.context_length + question_ids.shape[1],
                                 device=model.device)[None]
        out = model.model(input_ids=question_ids.to(model.device), past_key_values=cache, position_ids=positions,
                          output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    masses = []
    lo, hi = needle
    for layer_idx, attn in enumerate(out.attentions):
        if attn is None or layer_idx not in state.inputs:
            continue
        _, _, keys, _, _, _ = state.inputs[layer_idx]
        n_entries = attn.shape[-1] - question_ids.shape[1]
        kept = cache.layers[layer_idx].keys[:, :, :n_entries]
        start, end = entry_spans(press, layer_idx, keys, kept)
        covers = (start < hi) & (end > lo) & (start >= 0)  # (batch, kv_heads, entries)
        groups = attn.shape[1] // covers.shape[1]
        covers = covers.repeat_interleave(groups, dim=1)
        last = attn[:, :, -1, :n_entries]
        masses.append(float((last * covers).sum(-1).mean()))
    return sum(masses) / max(1, len(masses))
