"""The budget-layers diagnostic reads a layer's record right: masked padding is not attended, a pooled entry covers
its group, an uncompressed layer keeps everything; and the answer span it reads is the answer's tokens."""

from __future__ import annotations

import torch

from kvpress_phase.presses.stats import LayerStats
from studies.budget_layers import kept_answer


def test_masked_padding_does_not_count_and_a_group_covers_its_tokens():
    positions = torch.tensor([[[0, 4, 9], [2, 5, 5]]], dtype=torch.int32)  # head 1 pads with a second 5
    ends = torch.tensor([[[1, 8, 10], [3, 6, 6]]], dtype=torch.int32)  # head 0's entry 4 pools tokens 4-7
    stats = LayerStats(10, 3, 0.7, None, positions, ends=ends, masked=(torch.tensor([1]), torch.tensor([2])))
    entries, head_entries, any_head, mean_head = kept_answer(stats, 5, 7)  # answer tokens 5 and 6
    assert (entries, head_entries) == (3, 2.5)  # head 0: 3 attended, head 1: 2
    assert any_head == 1.0  # head 0's pooled group covers both
    assert mean_head == 0.75  # head 1 covers token 5 only
    masked_all = LayerStats(10, 3, 0.7, None, positions, ends=ends,
                            masked=(torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2])))
    assert kept_answer(masked_all, 5, 7)[2:] == (0.5, 0.25)  # only head 1's token 5 is left
    assert kept_answer(LayerStats(10, 10, 0.0, None, None), 5, 7) == (10, 10.0, 1.0, 1.0)


def test_the_answer_span_is_the_answers_tokens():
    from evaluation.prompting import context_token_ids
    from evaluation.tasks import generate
    from kvpress_phase.builtin import load_builtin_model

    _, tokenizer = load_builtin_model()
    rows = generate("niah_single", tokenizer, n_samples=2, context_length=256, stride=5, phases=range(5),
                    protocol="offset", seed=3)
    for row in rows:
        ids = context_token_ids(tokenizer, row["context"])
        span = tokenizer.decode(ids[row["answer_token_start"]:row["answer_token_end"]]).strip()
        assert span and span in row["answer"][0], (span, row["answer"])
