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

from gpu.lowbit_cpu import q8_rows
from gpu.model import DENSE_MIN_TOKENS, HEAD_DENSE_MIN_ROWS, LlamaModel, kv_pool_shape
from gpu.prepared import FORMAT_VERSION, cache_path, ensure_prepared, load_prepared, prepared_key, prepared_model
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


@pytest.mark.parametrize("rows", [1, 5])
def test_int4_and_int8_kernels_match_a_float32_linear_within_activation_rounding(rows):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((48, 128)).astype(np.float32)   # 48 rows: one whole tile of 32 and a padded one
    x = torch.from_numpy(rng.standard_normal((rows, 128)).astype(np.float32))
    for qtype in ("Q4_0", "Q4_1"):
        q4 = int4_groups_from_gguf(quantize(w, getattr(GGMLQuantizationType, qtype)), qtype, (48, 128))
        int4 = QuantLinear.int4(q4)
        ref4 = F.linear(x, q4.dequantize())
        assert int4.fn(x).shape == (rows, 48)
        # the only rounding is of x to int8 per group of 32 (|error| <= max|x_group| / 254 per element)
        assert torch.allclose(int4.fn(x), ref4, rtol=0.02, atol=0.02 * ref4.abs().max().item())
        assert torch.equal(int4.big(x), ref4)   # the float32 copy large batches run is the exact dequantization
    int8 = QuantLinear.int8(int8_groups_from_float(torch.from_numpy(w)))
    ref8 = F.linear(x, torch.from_numpy(w))
    assert torch.allclose(int8.fn(x), ref8, rtol=0.02, atol=0.02 * ref8.abs().max().item())
    assert int4.fn(x).dtype == int8.fn(x).dtype == torch.float32
    # an embedding lookup without the float32 table reads its rows back out of the tiles
    groups = int8_groups_from_float(torch.from_numpy(w))
    bare = QuantLinear.int8(groups, dense=False)
    ids = torch.tensor([0, 31, 32, 47])
    rows = (groups.codes.view(48, -1, 32).float() * groups.scale[..., None]).view(48, 128)[ids]
    assert torch.equal(q8_rows(ids, bare.tensors["tiles"], bare.tensors["tile_scale"]), rows)
    # rows of a batch are independent: each row's result is the one it gets alone
    assert torch.equal(int4.fn(x)[-1:], int4.fn(x[-1:].clone()))


def test_kernels_accumulate_without_integer_overflow_at_the_extreme_codes():
    # every code at its extreme and activations at +-max: the int16 partial sums are at their bound
    k = 64
    codes = torch.full((32, k), 15, dtype=torch.uint8)
    scale, zero = torch.full((32, k // 32), 0.5), torch.zeros(32, k // 32)
    int4 = QuantLinear.int4(Int4Groups(codes, scale, zero), dense=False)
    x = torch.full((1, k), -3.0)
    assert torch.allclose(int4.fn(x), F.linear(x, Int4Groups(codes, scale, zero).dequantize()))
    w8 = torch.full((32, k), -2.0)
    int8 = QuantLinear.int8(int8_groups_from_float(w8), dense=False)
    assert torch.allclose(int8.fn(x), F.linear(x, w8))


def test_permuted_and_stacked_q4_rows_stay_the_same_rows():
    w = np.random.default_rng(3).standard_normal((32, 64)).astype(np.float32)
    q4 = int4_groups_from_gguf(quantize(w, GGMLQuantizationType.Q4_0), "Q4_0", (32, 64))
    order = np.arange(32)[::-1].copy()
    both = Int4Groups.cat([q4, q4.take_rows(order)])
    assert torch.equal(both.dequantize(), torch.cat([q4.dequantize(), q4.dequantize()[torch.from_numpy(order)]]))


@pytest.fixture(scope="module")
def native_model(gguf_path) -> LlamaModel:
    return LlamaModel.from_path(gguf_path, progress=False, weights="auto")


@pytest.mark.parametrize("path", ["engine_prefill", "all_low_bit"])
def test_native_weights_agree_with_float32_on_most_next_tokens_of_english_text(model, native_model, tok, path):
    """``engine_prefill``: the engine's prefill (float32 copies, per-row attention, float32 output projection);
    ``all_low_bit``: the output projection on its int8 kernel too, as decode steps of a few rows run it."""
    from bench.quality import DEFAULT_TEXT, compare

    ids = tok.encode(DEFAULT_TEXT.read_text(encoding="utf-8"))[:257]
    if path == "all_low_bit":
        native_model.dense_min_tokens = native_model.head_dense_min_rows = 1 << 30
        native_model.prefill_head_dense = False
    try:
        res = compare(model, native_model, ids, chunk_tokens=128)
    finally:
        native_model.dense_min_tokens, native_model.head_dense_min_rows = DENSE_MIN_TOKENS, HEAD_DENSE_MIN_ROWS
        native_model.prefill_head_dense = True
    assert native_model.weights_mode == "native" and res["tokens"] == 256
    # all_low_bit: 244 of 256 with attention_cpu's tiles, perplexity 31.25 (float32 31.18); 243 with the per-row
    # loop before them (lowbit_cpu._attend), 246 with the per-sequence SDPA before that: each float order moves
    # int8 roundings, flipping near ties
    assert res["top1_agreement"] >= 0.94, res
    assert res["kl_mean"] < 0.005 and res["ppl_candidate"] <= 1.05 * res["ppl_reference"], res


def test_native_greedy_decode_continues_a_prompt_like_float32(model, native_model, tok):
    ids = tok.encode("The capital of France is Paris. The capital of Italy is")

    def greedy(m: LlamaModel, n: int = 6) -> tuple[list[int], list[float]]:
        kv = torch.zeros(kv_pool_shape(m.config, 8, 16))
        table = list(range(8))
        last = m.prefill(kv, ids, table)
        out, margins = [], []
        for step in range(n):
            top2 = last.topk(2).values
            out.append(int(last.argmax()))
            margins.append(float(top2[0] - top2[1]))
            last = m.decode(kv, [out[-1]], [len(ids) + step], [table])[0]
        return out, margins

    reference, margins = greedy(model)
    # equal up to float32's first near tie (step 6 here: " Spain" leads " the" by 0.04 logits; the int8 rounding
    # of activations moves with the float order of the ops before it, which torch's thread count changes)
    clear = next((i for i, m in enumerate(margins) if m < 0.2), len(margins))
    assert clear >= 4, margins
    assert tok.decode(greedy(native_model)[0][:clear]) == tok.decode(reference[:clear])


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
    stale["key"] = key.replace(f'"format": {FORMAT_VERSION}', '"format": 0')   # as if written by an older pdserve
    assert stale["key"] != key
    torch.save(stale, tmp_path / "stale")   # never in place: overwriting a mapped file's pages is a SIGBUS
    del stale
    os.replace(tmp_path / "stale", path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pdserve.prepared"):
        assert load_prepared(path, key) is None
    assert "another model or version" in caplog.text
    assert ensure_prepared(gguf_path, "auto", "cpu", tmp_path) == path   # rebuilt in place of the stale one
    assert torch.load(path, mmap=True, weights_only=True)["key"] == key


def test_native_decode_steps_agree_with_float32_on_most_next_tokens(model, native_model, tok):
    from bench.quality import DEFAULT_TEXT, compare

    ids = tok.encode(DEFAULT_TEXT.read_text(encoding="utf-8"))[:129]
    res = compare(model, native_model, ids, chunk_tokens=128, candidate_by_decode=True)
    assert native_model._stack_layers() is not None   # the one-call numba decode ran these steps
    assert res["tokens"] == 128 and res["top1_agreement"] >= 0.93, res
    assert res["ppl_candidate"] <= 1.05 * res["ppl_reference"], res


def test_one_call_decode_matches_the_op_by_op_decode_on_a_ragged_batch(native_model):
    m, c = native_model, native_model.config
    ids = list(range(300, 340))
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    lengths = [40, 17, 31]   # different positions: each row attends over its own keys only
    kv = torch.zeros(kv_pool_shape(c, 9, 16))
    for table, n in zip(tables, lengths):
        m.prefill(kv, ids[:n], table)
    kv_op = kv.clone()
    with torch.inference_mode():
        one_call = m.decode(kv, [7, 8, 9], lengths, tables)
        stacked, m._stacked = m._stacked, ()   # () = "not applicable": the op-by-op path, on the same kernels
        try:
            op_by_op = m.decode(kv_op, [7, 8, 9], lengths, tables)
        finally:
            m._stacked = stacked
    assert stacked
    # decode runs under inference_mode itself (its docstring), called here outside one
    assert m.decode(kv.clone(), [7], [lengths[0]], [tables[0]]).is_inference()
    # layer 0 reads the same embeddings through the same kernels: its K/V agree to float rounding
    assert torch.allclose(kv[0], kv_op[0], atol=1e-4)
    # deeper layers differ where an activation's int8 rounding flips; the distributions stay the same
    p, q = one_call.log_softmax(-1), op_by_op.log_softmax(-1)
    assert torch.equal(one_call.argmax(-1), op_by_op.argmax(-1))
    assert (p.exp() * (p - q)).sum(-1).max() < 0.02


def test_the_portable_q4_loop_gives_the_same_sums_as_the_one_the_host_runs():
    # hosts without AVX2 compile the Q4 loop's pair products in portable IR: check it here, where AVX2 is used
    import numba
    from numba.core import types
    from numba.extending import intrinsic

    from gpu import lowbit_cpu as lb

    @intrinsic
    def portable_group(typingctx, codes_addr, x_addr, scale_addr, min_addr, fx, sx, acc_addr):
        sig = types.void(types.intp, types.intp, types.intp, types.intp, types.float32, types.float32, types.intp)

        def codegen(context, builder, signature, args):
            ca, xa, sa, ma, fx_, sx_, aa = args
            lb._q4_rows_codegen(builder, ca, sa, ma, [(xa, fx_, sx_, aa)], x86=False)
            return context.get_dummy_value()

        return sig, codegen

    @numba.njit
    def portable(x, codes, scale, mins, y):
        xq, fx, sx = lb._quantized(x)
        acc = np.empty(lb.TILE_ROWS, np.float32)
        for t in range(codes.shape[0]):
            for b in range(x.shape[0]):
                acc[:] = 0.0
                for g in range(codes.shape[1]):
                    portable_group(codes[t, g].ctypes.data, xq[b, g * 32:].ctypes.data, scale[t, g].ctypes.data,
                                   mins[t, g].ctypes.data, fx[b, g], sx[b, g], acc.ctypes.data)
                y[b, t * lb.TILE_ROWS:(t + 1) * lb.TILE_ROWS] = acc

    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    q4 = int4_groups_from_gguf(quantize(w, GGMLQuantizationType.Q4_1), "Q4_1", (64, 96))
    tiles = lb.q4_tiles(q4.codes, q4.scale, q4.zero)
    x = torch.from_numpy(rng.standard_normal((3, 96)).astype(np.float32))
    y = np.empty((3, 64), np.float32)
    portable(x.numpy(), tiles["tiles"].numpy(), tiles["tile_scale"].numpy(), tiles["tile_min"].numpy(), y)
    # the integer sums are the same; the float epilogue may be fused differently (FMA) between compilations
    host = lb.q4_linear(x, 64, tiles["tiles"], tiles["tile_scale"], tiles["tile_min"])
    assert torch.allclose(torch.from_numpy(y), host, rtol=1e-6, atol=1e-5 * host.abs().max().item())
