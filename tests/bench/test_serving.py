"""bench/serving: the pure statistics and workload functions, and one small run against a real engine."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from tests.conftest import cleanup_engine, start_engine
from bench import serving as bs


def result(ttft: float, e2e: float, out: int, prompt: int = 10, itl=(), ok: bool = True) -> bs.RequestResult:
    return bs.RequestResult(ok=ok, prompt_len=prompt, output_len=out, ttft=ttft, e2e=e2e, itl=list(itl),
                            error="" if ok else "HTTP 503: overloaded")


def test_percentiles_match_numpy_linear_interpolation():
    rng = np.random.default_rng(0)
    xs = rng.exponential(size=37).tolist()
    got = bs.percentiles(xs, (0, 50, 90, 99, 100))
    for p in (0, 50, 90, 99, 100):
        assert got[f"p{p}"] == pytest.approx(float(np.percentile(xs, p)))
    assert got["mean"] == pytest.approx(float(np.mean(xs)))


def test_percentiles_of_nothing_are_nan_and_out_of_range_is_an_error():
    assert all(math.isnan(v) for v in bs.percentiles([]).values())
    with pytest.raises(ValueError):
        bs.percentiles([1.0], (101,))


def test_tpot_excludes_the_first_token_and_is_none_for_one_token():
    assert result(0.5, 1.5, 11).tpot == pytest.approx(0.1)
    assert result(0.5, 0.5, 1).tpot is None
    assert result(0.5, 1.5, 11, ok=False).tpot is None


def test_summarize_throughputs_and_latencies_in_ms():
    rs = [result(0.1, 1.1, 11, prompt=20, itl=[0.1] * 10), result(0.3, 2.3, 21, prompt=30, itl=[0.1] * 20),
          result(0, 0, 0, ok=False)]
    s = bs.summarize(rs, 4.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(32 / 4)
    assert s["total_token_throughput"] == pytest.approx((32 + 50) / 4)
    assert s["ttft_ms"]["mean"] == pytest.approx(200)
    assert s["ttft_ms"]["p50"] == pytest.approx(200)
    assert s["tpot_ms"]["p50"] == pytest.approx(100)
    assert s["itl_ms"]["p99"] == pytest.approx(100)
    assert s["e2e_ms"]["p90"] == pytest.approx(1100 + 0.9 * 1200)
    assert s["goodput"] is None
    assert s["errors"] == ["HTTP 503: overloaded"]


def test_goodput_counts_only_requests_within_every_slo():
    rs = [result(0.1, 1.1, 11),      # ttft 100 ms, tpot 100 ms: good
          result(0.5, 1.5, 11),      # ttft 500 ms: too slow to start
          result(0.1, 3.1, 11),      # tpot 300 ms: too slow to stream
          result(0.2, 0.2, 1),       # one token: no tpot, ttft fine: good
          result(0.1, 1.1, 11, ok=False)]
    s = bs.summarize(rs, 2.0, slo_ttft_ms=300, slo_tpot_ms=150)
    assert s["good_requests"] == 2
    assert s["goodput"] == pytest.approx(1.0)
    assert bs.summarize(rs, 2.0, slo_e2e_ms=1000)["good_requests"] == 1


def test_summarize_rejects_a_zero_duration():
    with pytest.raises(ValueError):
        bs.summarize([], 0.0)


def test_poisson_delays_have_the_requested_mean_and_inf_means_at_once():
    rng = random.Random(1)
    d = bs.poisson_delays(20000, 4.0, rng)
    assert np.mean(d) == pytest.approx(0.25, rel=0.05)
    assert bs.poisson_delays(5, math.inf, rng) == [0.0] * 5


class FakeTokenizer:
    vocab_size = 1000

    def encode(self, text: str) -> list[int]:
        return [int(w) for w in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(i) for i in ids)


def test_random_requests_stay_within_the_range_ratio_and_are_reproducible():
    a = bs.sample_random_requests(50, 100, 20, 0.5, random.Random(3), FakeTokenizer(), num_rounds=2)
    b = bs.sample_random_requests(50, 100, 20, 0.5, random.Random(3), FakeTokenizer(), num_rounds=2)
    assert [t.text for s in a for t in s.turns] == [t.text for s in b for t in s.turns]
    turns = [t for s in a for t in s.turns]
    assert len(a) == 50 and all(len(s.turns) == 2 for s in a)
    assert all(50 <= t.prompt_len <= 150 and 10 <= t.output_len <= 30 for t in turns)
    assert len({t.prompt_len for t in turns}) > 10
    fixed = bs.sample_random_requests(5, 8, 4, 0.0, random.Random(0), None)
    assert all(len(s.turns[0].text.split()) == 8 and s.turns[0].output_len == 4 and s.turns[0].prompt_len == -1
               for s in fixed)


def test_dataset_takes_first_user_turn_and_reply_length_or_all_turns_in_multi_turn():
    lines = [json.dumps({"conversations": [{"from": "human", "value": "1 2 3"}, {"from": "gpt", "value": "4 5 6 7 8"},
                                           {"from": "human", "value": "9"}, {"from": "gpt", "value": "10"}]}),
             "",
             json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "11 12"}]})]
    single = bs.load_dataset(lines, 2, random.Random(0), tokenizer=FakeTokenizer(), shuffle=False, min_output_len=1)
    assert [(t.text, t.prompt_len, t.output_len) for s in single for t in s.turns] == [
        ("1 2 3", 3, 5), ("11 12", 2, 128)]
    multi = bs.load_dataset(lines, 3, random.Random(0), tokenizer=FakeTokenizer(), multi_turn=True,
                            output_len=7, shuffle=False)
    assert [[t.text for t in s.turns] for s in multi] == [["1 2 3", "9"], ["11 12"], ["1 2 3", "9"]]
    assert all(t.output_len == 7 for s in multi for t in s.turns)
    with pytest.raises(ValueError, match="line 1"):
        bs.load_dataset(["{not json"], 1, random.Random(0))
    with pytest.raises(ValueError, match="no record"):
        bs.load_dataset([json.dumps({"messages": [{"role": "assistant", "content": "x"}]})], 1, random.Random(0))


def test_ignore_eos_is_sent_only_when_asked():
    args = bs.build_parser().parse_args([])
    _, body = bs._payload("completions", "m", [], bs.Turn("hi", 1, 4), args)
    assert "ignore_eos" not in body and body["stream"] and body["max_tokens"] == 4
    args = bs.build_parser().parse_args(["--ignore-eos"])
    path, body = bs._payload("chat", "m", [("user", "a"), ("assistant", "b")], bs.Turn("hi", 1, 4), args)
    assert path == "/v1/chat/completions" and body["ignore_eos"] is True
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]


def test_report_formats_nan_as_na():
    s = bs.summarize([], 1.0, slo_ttft_ms=100)
    text = bs.format_report(s)
    assert "n/a" in text and "Goodput" in text


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = start_engine(tmp_path_factory.mktemp("bench_serving"), "--kv-pool-tokens", "2048", "--max-num-seqs", "8")
    yield eng
    cleanup_engine(eng)


@pytest.mark.timeout(360)   # counts the module engine's start: a fresh checkout compiles the numba kernels (~2 min)
def test_a_small_run_against_a_real_engine_measures_every_request(engine, tmp_path):
    out = tmp_path / "runs.jsonl"
    s = bs.main(["--base-url", engine.base_url + "/v1", "--num-prompts", "4", "--max-concurrency", "2",
                 "--input-len", "16", "--output-len", "4", "--ignore-eos", "--json", "--disable-progress",
                 "--slo-ttft-ms", "60000", "--output-file", str(out)])
    assert (s["completed"], s["failed"]) == (4, 0), s["errors"]
    assert s["total_output_tokens"] == 16 and s["output_len_source"] == "server usage"
    assert s["good_requests"] == 4
    assert 0 < s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]
    assert s["itl_ms"]["p50"] > 0 and s["tpot_ms"]["p50"] > 0
    assert json.loads(out.read_text())["completed"] == 4


@pytest.mark.timeout(120)
def test_multi_round_chat_sessions_carry_the_history(engine):
    """One session of three rounds: each round's prompt holds the previous round's prompt and reply (and a new
    user turn), by the server's own prompt_tokens count."""
    import asyncio

    args = bs.parse_args(["--base-url", engine.base_url, "--endpoint", "chat", "--num-prompts", "1",
                          "--num-rounds", "3", "--input-len", "8", "--output-len", "3", "--ignore-eos",
                          "--disable-progress", "--warmup-requests", "0"])
    tokenizer = bs.load_tokenizer(args.tokenizer)
    results, _ = asyncio.run(bs.run_benchmark(args, bs.build_sessions(args, tokenizer), tokenizer))
    assert [(r.ok, r.output_len, r.usage_reported) for r in results] == [(True, 3, True)] * 3, \
        [r.error for r in results]
    for before, after in zip(results, results[1:]):   # one session: its rounds in order
        assert after.prompt_len > before.prompt_len + before.output_len, [r.prompt_len for r in results]
