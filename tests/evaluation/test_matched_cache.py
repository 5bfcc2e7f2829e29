"""``--matched-cache`` for kvpress's ChunkPress: one ratio reaches only the counts its per-chunk rounding gives, so at
1,024 tokens, chunk length 20 and ratio 0.25 it keeps 768 entries against ChunkedStridePress's 779 (no ratio gives
779); the help, README.md and the report say so and show the count each answer had."""

from __future__ import annotations

import os
import re

import pytest
import torch
from transformers import DynamicCache

from kvpress_phase.evaluation.presses import build_press, parse_press_spec
from kvpress_phase.core.phase import compressed_length
from tiny_models import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONTEXT, L, RATIO = 1024, 20, 0.25


def _kept(model, ids, press) -> int:
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    lengths = {layer.keys.shape[2] for layer in cache.layers}
    assert len(lengths) == 1
    return lengths.pop()


def test_chunkpress_at_a_matched_cache_keeps_what_its_chunks_round_to_and_no_ratio_does_better():
    model = tiny_model("llama")
    ids = torch.randint(4, 60, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    ours = _kept(model, ids, build_press(parse_press_spec("chunked_stride"), RATIO, L, None, 0))
    assert ours == compressed_length(CONTEXT, L, RATIO) == 779
    matched = build_press(parse_press_spec("chunk"), RATIO, L, None, 0, matched_context_length=CONTEXT)
    assert _kept(model, ids, matched) == 768  # 51 chunks of 20 keep 15 each, the last 4 tokens keep 3
    # every count ChunkPress can keep: its counts change only where a chunk's int(L * (1 - r)) or the last chunk's
    # int(4 * (1 - r)) does, so one ratio between each pair of neighbouring steps reaches them all
    steps = sorted({j / L for j in range(L + 1)} | {j / 4 for j in range(5)})
    reachable = {}
    for lo, hi in zip(steps, steps[1:]):
        r = (lo + hi) / 2
        press = build_press(parse_press_spec("chunk"), RATIO, L, None, 0)
        press.compression_ratio = r
        reachable[_kept(model, ids, press)] = r
    assert ours not in reachable  # exactness is impossible for ChunkPress here
    # the matched ratio's 768 is the closest count that does not exceed ours
    assert max(n for n in reachable if n <= ours) == 768 and min(n for n in reachable if n > ours) == 819
    # a scorer press matches exactly
    assert _kept(model, ids, build_press(parse_press_spec("knorm"), RATIO, L, None, 0,
                                         matched_context_length=CONTEXT)) == ours


def test_the_help_and_the_readme_say_what_matched_cache_matches(capsys):
    from kvpress_phase.evaluation.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "exactly for kvpress's scorer presses" in help_text
    assert "768 against 779 at 1,024 tokens, L = 20, ratio 0.25" in help_text and "cache_length" in help_text
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        readme = " ".join(fh.read().split())
    matched = re.search(r"\*\*Matched cache\*\*(.*?)- \*\*", readme).group(1)
    assert "`ChunkPress` keeps `int(L * (1 - ratio))` entries of every chunk" in matched
    assert "768 against 779 at 1,024 tokens, `L` = 20, ratio 0.25, where no ratio gives it 779" in matched


def test_the_report_shows_the_cache_length_of_every_cell():
    from kvpress_phase.evaluation.report import summary_table

    record = dict(task="niah_single", context_length=1024, press="chunk", compression_ratio=0.25,
                  achieved_ratio=0.25, cache_length=768.0, stride=20, protocol="prefix", setting="query_agnostic",
                  mean=1.0, worst=1.0, boundary=1.0, p_value=1.0, gap_xfit=0.0, gap_xfit_ci_low=0.0,
                  gap_xfit_ci_high=0.0, detectable_gap=0.5, gap=0.0, n_samples=4, per_phase=[1.0] * 20,
                  per_depth=None)
    table = summary_table([record])
    assert list(table.columns[table.columns.get_loc("achieved"):][:2]) == ["achieved", "cache"]
    assert table["cache"].iloc[0] == 768.0
