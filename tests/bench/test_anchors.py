"""bench/anchors: its arguments, the refusal without a llama-server, and the ratio table on given figures
(no server is started here; the benchmark's figures are never asserted)."""
from __future__ import annotations

import os
import stat

import pytest

from bench import anchors as ba
from bench import serving as bs


def test_defaults_run_every_part_with_the_nocache_variant_in_multiround_only():
    args = ba.parse_args([])
    assert args.parts == ["single", "concurrent", "multiround"]
    assert args.variants == [("pdserve", []), ("pdserve-nocache", ["--no-prefix-cache"])]
    assert args.variant_parts == {"multiround"}


def test_only_and_variants_with_common_pdserve_args():
    args = ba.parse_args(["--only", "single, multiround", "--pdserve-args", "--max-num-seqs 32",
                          "--variant", "native=--weights auto", "--variant", "fp32=--weights float32"])
    assert args.parts == ["single", "multiround"]
    assert args.variants == [("native", ["--max-num-seqs", "32", "--weights", "auto"]),
                             ("fp32", ["--max-num-seqs", "32", "--weights", "float32"])]


@pytest.mark.parametrize("argv", [["--only", "single,bogus"], ["--only", ","], ["--variant", "noequals"],
                                  ["--variant", "hf=--x"], ["--variant", "a=", "--variant", "a=--b"],
                                  ["--reps", "0"], ["--variant-parts", "warm"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        ba.parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_refuses_with_the_build_command_when_the_binary_is_absent(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setattr(ba, "CACHE_DIR", tmp_path)
    assert ba.find_llama_server() is None
    with pytest.raises(SystemExit) as exc:
        ba.require_llama_server()
    assert "bench/build_llama_server.sh" in str(exc.value.code)
    with pytest.raises(SystemExit) as exc:
        ba.main(["--only", "single"])  # refuses before starting anything
    assert "no llama-server binary" in str(exc.value.code)
    not_executable = tmp_path / "llama-server"
    not_executable.write_text("")
    with pytest.raises(SystemExit):
        ba.require_llama_server(str(not_executable))


def test_finds_the_newest_build_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setattr(ba, "CACHE_DIR", tmp_path)
    paths = []
    for i, version in enumerate(("1.0", "2.0")):
        p = tmp_path / f"llama.cpp-{version}" / "build" / "bin" / "llama-server"
        p.parent.mkdir(parents=True)
        p.write_text("#!/bin/sh\n")
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
        os.utime(p, (1000 + i, 1000 + i))
        paths.append(p)
    assert ba.find_llama_server() == paths[1]
    assert ba.require_llama_server(str(paths[0])) == paths[0]


def test_unknown_flags_are_those_the_help_does_not_list():
    help_text = "usage: pdserve serve [-h] [--model MODEL]\n  --max-num-seqs MAX_NUM_SEQS  most requests [32]"
    assert ba.unknown_flags(["--max-num-seqs", "8", "--no-prefix-cache", "--model=x"], help_text) == \
        ["--no-prefix-cache"]
    assert ba.unknown_flags([], help_text) == []


def _fig(tok_s, ttft, itl, e2e=None, cached=None):
    return {"output_tok_s": tok_s, "ttft_p50_ms": ttft, "itl_p50_ms": itl, "e2e_p50_ms": e2e,
            "cached_share": cached, "completed": 4, "failed": 0, "errors": []}


def test_ratio_rows_divide_pdserve_by_each_baseline_present():
    results = {
        "single cold": {"pdserve": ba.median_figures([_fig(20.0, 300.0, 50.0)]),
                        ba.LLAMA: ba.median_figures([_fig(80.0, 100.0, 12.5)]),
                        ba.HF: ba.median_figures([_fig(10.0, 250.0, None)])},
        "multiround": {"pdserve": ba.median_figures([_fig(30.0, 200.0, 40.0, 900.0, 0.9)]),
                       "pdserve-nocache": ba.median_figures([_fig(15.0, 2000.0, 40.0, 3000.0)]),
                       ba.LLAMA: ba.median_figures([_fig(60.0, 50.0, 15.0, 450.0, 0.95)])},
    }
    rows = ba.ratio_rows(results, ["pdserve", "pdserve-nocache"])
    assert [(r["scenario"], r["system"]) for r in rows] == [
        ("single cold", "pdserve"), ("single cold", ba.LLAMA), ("single cold", ba.HF),
        ("multiround", "pdserve"), ("multiround", "pdserve-nocache"), ("multiround", ba.LLAMA)]
    single = rows[0]["ratios"]
    assert single["output_tok_s_vs_llama-server"] == pytest.approx(0.25)
    assert single["output_tok_s_vs_hf"] == pytest.approx(2.0)
    assert single["ttft_p50_ms_vs_llama-server"] == pytest.approx(3.0)
    assert "itl_p50_ms_vs_hf" not in single  # HF's ITL is None here: no ratio rather than a wrong one
    assert rows[1]["ratios"] == {} and rows[2]["ratios"] == {}  # baselines get no ratios
    mr = rows[3]["ratios"]
    assert mr["e2e_p50_ms_vs_pdserve-nocache"] == pytest.approx(0.3)
    assert mr["output_tok_s_vs_pdserve-nocache"] == pytest.approx(2.0)
    assert rows[4]["ratios"]["e2e_p50_ms_vs_pdserve"] == pytest.approx(1 / 0.3)
    table = ba.format_table(rows)
    assert "vs llama-server: tok/s 0.25x TTFT 3.00x" in table
    assert "vs hf: tok/s 2.00x" in table
    assert "vs pdserve-nocache: tok/s 2.00x TTFT 0.10x round 0.30x" in table
    assert "90%" in table


def test_median_figures_over_repetitions_skips_missing_figures():
    med = ba.median_figures([_fig(10.0, 100.0, None), _fig(30.0, 300.0, None), _fig(20.0, 200.0, 5.0)])
    assert med["output_tok_s"] == 20.0 and med["ttft_p50_ms"] == 200.0
    assert med["itl_p50_ms"] == 5.0 and med["cached_share"] is None
    assert med["completed"] == 12 and med["reps"] == 3


def test_figures_from_summary_count_cached_tokens_after_the_first_rounds():
    rs = [bs.RequestResult(ok=True, prompt_len=100, output_len=10, ttft=0.2, e2e=1.0, itl=[0.1] * 9),
          bs.RequestResult(ok=True, prompt_len=200, output_len=10, ttft=0.1, e2e=0.9, itl=[0.1] * 9,
                           cached_tokens=90),
          bs.RequestResult(ok=True, prompt_len=300, output_len=10, ttft=0.1, e2e=0.9, itl=[0.1] * 9,
                           cached_tokens=200)]
    summary = bs.summarize(rs, 3.0)
    assert summary["total_cached_tokens"] == 290
    fig = ba.figures_from_summary(summary, first_round_prompt_tokens=100)
    assert fig["cached_share"] == pytest.approx(290 / 500)
    assert fig["output_tok_s"] == pytest.approx(10.0)
    assert fig["ttft_p50_ms"] == pytest.approx(100.0)
    assert ba.figures_from_summary(bs.summarize(rs[:1], 1.0))["cached_share"] is None


def test_the_build_script_refuses_to_build_in_ci(tmp_path):
    import subprocess

    env = {**os.environ, "CI": "true", "LLAMA_ANCHORS_CACHE": str(tmp_path)}
    out = subprocess.run(["bash", str(ba.ROOT / "bench" / "build_llama_server.sh")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "refusing to build llama.cpp in CI" in out.stderr
    assert list(tmp_path.iterdir()) == []  # nothing fetched or unpacked


def test_a_run_where_every_request_failed_has_no_figures_and_no_ratios():
    failed = [bs.RequestResult(ok=False, error="HTTP 503: no prefill actor is serving")] * 2
    fig = ba.figures_from_summary(bs.summarize(failed, 1.0))
    assert fig["output_tok_s"] is None and fig["ttft_p50_ms"] is None and fig["failed"] == 2
    rows = ba.ratio_rows({"single cold": {"pdserve": ba.median_figures([fig]),
                                          ba.LLAMA: ba.median_figures([_fig(80.0, 100.0, 12.5)])}}, ["pdserve"])
    assert rows[0]["ratios"] == {}
    assert "2 failed: HTTP 503" in ba.format_table(rows)
