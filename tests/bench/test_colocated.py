"""bench/colocated: the order and prompts of the interleaved low-load requests and the paired ratios (no
server is started here; the benchmark's own figures are never asserted)."""
from __future__ import annotations

import pytest

from bench import colocated as bc


def test_every_engine_gets_each_prompt_and_the_order_rotates():
    labels = ["disaggregated", "colocated", "baseline disaggregated", "baseline colocated"]
    plan = bc.low_load_plan(4, labels)
    assert [runs[0][0] for runs in plan] == labels   # each engine goes first once in four prompts
    assert all(sorted(label for label, _ in runs) == sorted(labels) for runs in plan)
    assert [{seed for _, seed in runs} for runs in plan] == [{1}, {2}, {3}, {4}]


def test_ratios_pair_the_two_modes_prompt_by_prompt():
    summary = bc.ratio_summary([440.0, 450.0, 330.0], [400.0, 500.0, 300.0])
    assert summary["median"] == pytest.approx(1.1) and summary["q1"] == pytest.approx(0.9)
    assert (summary["dis_p50"], summary["col_p50"]) == (440.0, 400.0)


def test_defaults_are_16_prompts_of_64_tokens_and_16_output_tokens_with_no_baseline():
    args = bc.parse_args([])
    assert (args.num_prompts, args.input_len, args.output_len, args.baseline_root) == (16, 64, 16, "")
