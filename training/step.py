"""One training step of compression-aware fine-tuning (what a step does is described in :mod:`.finetune`).

:func:`forward_group` prefills a group of contexts of one length under the press, teacher-forces question and
answer on the compressed cache and returns the summed answer-token loss; :func:`train_step` runs every group of
every micro-batch of a step and backpropagates.
"""

from __future__ import annotations

from .config import FinetuneConfig
from .data import ExampleSource
from .models import base_model


def group_by_context_length(examples: list[dict]) -> list[list[int]]:
    """Indices of ``examples`` grouped by ``context_length``, groups in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault(ex["context_length"], []).append(i)
    return list(groups.values())


def forward_group(model, examples: list[dict], press, pad_id: int, autocast):
    """Prefill the contexts of ``examples`` (all of one length) under ``press``, teacher-force question and
    answer on the compressed cache, and return ``(summed answer-token loss, per-row exact match, cache length)``.
    """
    import torch
    import torch.nn.functional as F
    from transformers import DynamicCache

    lm = base_model(model)
    device = next(lm.parameters()).device
    n = examples[0]["context_length"]
    context = torch.tensor([ex["input_ids"][:n] for ex in examples], device=device)
    tails = [ex["input_ids"][n:] for ex in examples]
    masks = [ex["loss_mask"][n:] for ex in examples]
    width = max(len(t) for t in tails)
    qa = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (tail, mask) in enumerate(zip(tails, masks)):
        qa[row, : len(tail)] = torch.tensor(tail)
        labels[row, : len(tail)] = torch.tensor([t if m else -100 for t, m in zip(tail, mask)])
    qa, labels = qa.to(device), labels.to(device)
    # right padding: a real token never attends to the padding after it, and padding carries no loss
    positions = torch.arange(n, n + width, device=device).unsqueeze(0).expand(len(examples), -1)
    cache = DynamicCache()
    with autocast():
        if press is None:
            lm.model(input_ids=context, past_key_values=cache, use_cache=True)
        else:
            with press(lm):
                lm.model(input_ids=context, past_key_values=cache, use_cache=True)
        cache_length = cache.get_seq_length()
        logits = lm(input_ids=qa, past_key_values=cache, position_ids=positions, use_cache=True).logits
    from .loop import answer_exact_match

    shifted = logits[:, :-1].float()
    loss_sum = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=-100, reduction="sum")
    return loss_sum, answer_exact_match(logits.detach(), labels), cache_length


def train_step(model, config: FinetuneConfig, source: ExampleSource, step: int, pad_id: int, autocast) -> dict:
    """Forward and backward passes of every micro-batch of ``step`` (the gradients accumulate in ``model``);
    return the step's metrics for the training log.

    Each micro-batch draws its press (:meth:`FinetuneConfig.draw_press`; none when its ratio is 0) and its
    examples (:meth:`ExampleSource.micro_batch`), and is run as one forward pass per context length. The loss of the
    step is the sum over all its answer tokens divided by their number, whatever the grouping and the gradient
    accumulation, so both leave the gradient unchanged.
    """
    micro_batches = []
    for micro in range(config.grad_accum):
        examples, kinds, length = source.micro_batch(step, micro)
        micro_batches.append((config.draw_press(step, micro), examples, length))
    tokens = sum(sum(ex["loss_mask"]) for _, examples, _ in micro_batches for ex in examples)
    loss_total, matches, cache_lengths = 0.0, [], []
    for draw, examples, _ in micro_batches:
        press = config.build_press(draw["ratio"], draw["stride"], draw["offset"]) if draw["ratio"] > 0 else None
        for group in group_by_context_length(examples):
            loss_sum, em, cache_length = forward_group(model, [examples[i] for i in group], press, pad_id,
                                                       autocast)
            (loss_sum / tokens).backward()
            loss_total += float(loss_sum.detach())
            matches += em.tolist()
            cache_lengths.append(cache_length)
    return {"loss": loss_total / tokens, "acc": sum(matches) / len(matches),
            "ratios": [d["ratio"] for d, _, _ in micro_batches],
            "strides": [d["stride"] for d, _, _ in micro_batches],
            "offsets": [d["offset"] for d, _, _ in micro_batches],
            "lengths": [n for _, _, n in micro_batches], "cache_lengths": cache_lengths}
