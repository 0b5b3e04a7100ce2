"""tools/bench_colocated: the order and prompts of the interleaved low-load runs and the per-repetition ratios
(no server is started here; the benchmark's own figures are never asserted)."""
from __future__ import annotations

from tools import bench_colocated as bc


def test_modes_alternate_which_goes_first_and_share_a_new_seed_each_repetition():
    plan = bc.low_load_plan(4)
    assert [[mode for mode, _ in runs] for runs in plan] == [["disaggregated", "colocated"],
                                                             ["colocated", "disaggregated"]] * 2
    seeds = [{seed for _, seed in runs} for runs in plan]
    assert all(len(s) == 1 for s in seeds) and len(set.union(*seeds)) == 4


def test_each_repetition_gives_its_own_ratio_of_the_two_ttft_medians():
    def result(p50_ms):
        return {"ttft_ms": {"p50": p50_ms}}
    low = [{"disaggregated": result(440.0), "colocated": result(400.0)},
           {"colocated": result(500.0), "disaggregated": result(450.0)}]
    assert bc.low_load_rows(low) == [(440.0, 400.0, 1.1), (450.0, 500.0, 0.9)]
