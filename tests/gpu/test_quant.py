"""Native low-bit weights (gpu/quant.py) and the prepared-model cache (gpu/prepared.py).

The unpacking is checked against the gguf library's own dequantization, the kernels against a float32
``F.linear``, the native model against the float32 one on real text, and the cache against damaged files.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from gpu.model import DENSE_MIN_TOKENS, HEAD_DENSE_MIN_ROWS, LlamaModel, kv_pool_shape
from gpu.prepared import cache_path, ensure_prepared, load_prepared, prepared_key, prepared_model
from gpu.quant import Int4Groups, QuantLinear, int4_groups_from_gguf, int8_groups_from_float

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_q4_blocks_unpack_to_exactly_what_gguf_dequantizes(qtype):
    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    raw = quantize(w, qtype)
    groups = int4_groups_from_gguf(raw, qtype.name, (48, 96))
    assert int(groups.codes.max()) <= 15
    assert torch.equal(groups.dequantize(), torch.from_numpy(dequantize(raw, qtype).astype(np.float32)))


def test_q8_0_values_come_back_to_their_own_codes_and_scales():
    w = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    q8 = torch.from_numpy(dequantize(quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0))
    groups = int8_groups_from_float(q8)
    recon = groups.codes.view(16, 2, 32).float() * groups.scale[..., None]
    assert torch.equal(recon.view(16, 64), q8)


def test_int4_and_int8_kernels_match_a_float32_linear_within_bfloat16_rounding():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    x = torch.from_numpy(rng.standard_normal((3, 128)).astype(np.float32))
    q4 = int4_groups_from_gguf(quantize(w, GGMLQuantizationType.Q4_1), "Q4_1", (64, 128))
    int4 = QuantLinear.int4(q4)
    ref4 = F.linear(x, q4.dequantize())
    assert torch.allclose(int4.fn(x), ref4, rtol=0.02, atol=0.05 * ref4.abs().max().item())
    assert torch.equal(int4.big(x), ref4)   # the float32 copy large batches run is the exact dequantization
    int8 = QuantLinear.int8(int8_groups_from_float(torch.from_numpy(w)))
    ref8 = F.linear(x, torch.from_numpy(w))
    assert torch.allclose(int8.fn(x), ref8, rtol=0.02, atol=0.02 * ref8.abs().max().item())
    assert int4.fn(x).dtype == int8.fn(x).dtype == torch.float32
    # ``raw`` skips only the final cast: the decode loop promotes its bfloat16 output itself, exactly
    assert int4.raw(x).dtype == torch.bfloat16 and torch.equal(int4.raw(x).float(), int4.fn(x))
    assert torch.equal(int4.raw(x.bfloat16()), int4.raw(x))
    assert torch.equal(int8.raw(x), int8.fn(x))


def test_permuted_and_stacked_q4_rows_stay_the_same_rows():
    w = np.random.default_rng(3).standard_normal((32, 64)).astype(np.float32)
    q4 = int4_groups_from_gguf(quantize(w, GGMLQuantizationType.Q4_0), "Q4_0", (32, 64))
    order = np.arange(32)[::-1].copy()
    both = Int4Groups.cat([q4, q4.take_rows(order)])
    assert torch.equal(both.dequantize(), torch.cat([q4.dequantize(), q4.dequantize()[torch.from_numpy(order)]]))


@pytest.fixture(scope="module")
def native_model(gguf_path) -> LlamaModel:
    return LlamaModel.from_path(gguf_path, progress=False, weights="auto")


def test_native_weights_agree_with_float32_on_most_next_tokens_of_english_text(model, native_model, tok):
    from tools.bench_quality import DEFAULT_TEXT, compare

    ids = tok.encode(DEFAULT_TEXT.read_text(encoding="utf-8"))[:257]
    # the low-bit kernels on every forward, as decode steps of a few rows run them
    native_model.dense_min_tokens = native_model.head_dense_min_rows = 1 << 30
    try:
        res = compare(model, native_model, ids, chunk_tokens=128)
    finally:
        native_model.dense_min_tokens, native_model.head_dense_min_rows = DENSE_MIN_TOKENS, HEAD_DENSE_MIN_ROWS
    assert native_model.weights_mode == "native" and res["tokens"] == 256
    assert res["top1_agreement"] >= 0.95, res
    assert res["ppl_candidate"] <= 1.05 * res["ppl_reference"], res


def test_native_greedy_decode_continues_a_prompt_like_float32(model, native_model, tok):
    ids = tok.encode("The capital of France is Paris. The capital of Italy is")

    def greedy(m: LlamaModel, n: int = 6) -> list[int]:
        kv = torch.zeros(kv_pool_shape(m.config, 8, 16))
        table = list(range(8))
        last = m.prefill(kv, ids, table)
        out = []
        for step in range(n):
            out.append(int(last.argmax()))
            last = m.decode(kv, [out[-1]], [len(ids) + step], [table])[0]
        return out

    assert tok.decode(greedy(native_model)) == tok.decode(greedy(model))


@pytest.fixture(scope="module")
def prepared_file(gguf_path, tmp_path_factory) -> Path:
    return ensure_prepared(gguf_path, "auto", "cpu", tmp_path_factory.mktemp("prepared"))


def test_a_prepared_model_maps_back_to_the_same_logits(gguf_path, native_model, prepared_file):
    assert not list(prepared_file.parent.glob("*.tmp"))
    mapped = prepared_model(gguf_path, "auto", cache_dir=prepared_file.parent)
    assert mapped.weights_mode == native_model.weights_mode == "native"
    kv_a, kv_b = (torch.zeros(kv_pool_shape(m.config, 2, 16)) for m in (native_model, mapped))
    assert torch.equal(native_model.prefill(kv_a, [1, 2, 3], [0, 1]), mapped.prefill(kv_b, [1, 2, 3], [0, 1]))
    assert torch.equal(native_model.decode(kv_a, [4], [3], [[0, 1]]), mapped.decode(kv_b, [4], [3], [[0, 1]]))


def test_a_damaged_or_stale_prepared_file_is_refused_and_rebuilt(gguf_path, prepared_file, tmp_path, caplog):
    key = prepared_key(gguf_path, "native")
    path = cache_path(tmp_path, key)
    good = prepared_file.read_bytes()
    path.write_bytes(good[: len(good) // 2])   # truncated, as a copy cut short
    with caplog.at_level(logging.WARNING, logger="pdserve.prepared"):
        assert load_prepared(path, key) is None
    assert "unreadable" in caplog.text
    stale = torch.load(prepared_file, mmap=True, weights_only=True)
    stale["key"] = key.replace('"format": 1', '"format": 0')   # as if written by an older pdserve
    torch.save(stale, tmp_path / "stale")   # never in place: overwriting a mapped file's pages is a SIGBUS
    del stale
    os.replace(tmp_path / "stale", path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pdserve.prepared"):
        assert load_prepared(path, key) is None
    assert "another model or version" in caplog.text
    assert ensure_prepared(gguf_path, "auto", "cpu", tmp_path) == path   # rebuilt in place of the stale one
    assert torch.load(path, mmap=True, weights_only=True)["key"] == key
