"""bench/multinode: its arguments, the figures of a bench_serving summary, the medians and two-node /
single-node ratios, the table, and the skip without root (no server is started here; the benchmark's own figures
are never asserted)."""
from __future__ import annotations

import pytest

from bench import multinode as bm
from bench import serving as bs


def test_defaults_are_concurrency_1_and_8_with_64_token_prompts_and_16_output_tokens():
    args = bm.parse_args([])
    assert (args.concurrency, args.input_len, args.output_len, args.reps) == ([1, 8], 64, 16, 3)
    assert [bm.num_prompts(args, c) for c in args.concurrency] == [4, 16]
    args = bm.parse_args(["--concurrency", "4", "--num-prompts", "6", "--flags", "--kv-pool-tokens 8192"])
    assert args.concurrency == [4] and bm.num_prompts(args, 4) == 6 and args.flags == "--kv-pool-tokens 8192"


@pytest.mark.parametrize("argv", [["--concurrency", "0"], ["--reps", "0"], ["--input-len", "0"],
                                  ["--output-len", "-1"], ["--concurrency", "x"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bm.parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def _summary(ttfts_s: list[float], itl_s: float, failed: int = 0) -> dict:
    results = [bs.RequestResult(ok=True, prompt_len=64, output_len=3, ttft=t, e2e=t + 2 * itl_s, itl=[itl_s] * 2)
               for t in ttfts_s] + [bs.RequestResult(ok=False, error="HTTP 503") for _ in range(failed)]
    return bs.summarize(results, duration_s=2.0)


def test_figures_take_ttft_p50_p90_itl_p50_and_output_rate_from_the_summary():
    figs = bm.figures(_summary([0.1, 0.2, 0.3, 0.4, 0.5], 0.05, failed=1))
    assert figs["ttft_p50_ms"] == pytest.approx(300) and figs["ttft_p90_ms"] == pytest.approx(460)
    assert figs["itl_p50_ms"] == pytest.approx(50) and figs["output_tok_s"] == pytest.approx(15 / 2.0)
    assert (figs["completed"], figs["failed"], figs["errors"]) == (5, 1, ["HTTP 503"])


def test_a_run_where_every_request_failed_has_no_figures_not_zeros():
    figs = bm.figures(_summary([], 0.05, failed=2))
    assert [figs[f] for f in bm.FIGURES] == [None] * 4 and figs["failed"] == 2


def _figs(ttft_p50, itl_p50=50.0, tok_s=10.0, failed=0):
    return {"ttft_p50_ms": ttft_p50, "ttft_p90_ms": ttft_p50 * 2 if ttft_p50 else None, "itl_p50_ms": itl_p50,
            "output_tok_s": tok_s, "completed": 4, "failed": failed, "errors": ["HTTP 504"] if failed else []}


def test_rows_hold_medians_over_repetitions_and_two_node_over_single_node_ratios():
    runs = {1: {"single-node": [_figs(100), _figs(300), _figs(200)],
                "two-node": [_figs(150), _figs(330), _figs(None, None, None, failed=4)]},
            8: {"single-node": [_figs(1000, tok_s=40.0)], "two-node": [_figs(1500, itl_p50=75.0, tok_s=30.0)]}}
    rows = bm.build_rows(runs)
    assert [r["concurrency"] for r in rows] == [1, 8]
    one, eight = rows
    assert one["single-node"]["ttft_p50_ms"] == 200 and one["two-node"]["ttft_p50_ms"] == 240   # None left out
    assert one["ratios"]["ttft_p50_ms"] == pytest.approx(1.2) and one["two-node"]["failed"] == 4
    assert one["ttft_p50_ratio_per_rep"] == [pytest.approx(1.5), pytest.approx(1.1), None]
    assert one["ttft_p50_ratio_paired_median"] == pytest.approx(1.3)   # the failed repetition has no ratio
    assert eight["ratios"] == {"ttft_p50_ms": 1.5, "ttft_p90_ms": 1.5, "itl_p50_ms": 1.5, "output_tok_s": 0.75}
    table = bm.format_table(rows)
    assert "two / single" in table and "1.50x" in table and "0.75x" in table
    assert "TTFT p50 two / single per repetition: 1.50x, 1.10x, - (median 1.30x)" in table
    assert "[4 failed: HTTP 504]" in table


def test_without_root_it_says_why_and_starts_nothing(monkeypatch, capsys):
    pytest.importorskip("ipc.mooncake_transport", reason="the mooncake extra is missing (its own skip reason)")
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert bm.main(["--reps", "1"]) == {"skipped": "network namespaces need root (running as uid 1000)"}
    assert "bench_multinode skipped: network namespaces need root" in capsys.readouterr().out
