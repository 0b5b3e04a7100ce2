"""K-quant weights (GGUF Q4_K, Q5_K, Q6_K and the Q5_0/Q5_1 fallbacks of a Q4_K_M file) kept low-bit.

The blocks come from tools/kquantize.py's reference quantizer; the unpacking is checked against the gguf
library's own dequantization, the GEMV against a float64 product of that dequantized weight with the
int8-rounded activations (the kernel's only rounding), and a Q4_K_M re-quantization of the embedded model
against its own float32 path.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from gpu.quant import Int4Groups, Int5Groups, Int8HalfGroups, QuantLinear, kquant_groups_from_gguf
from tools.kquantize import quantize, requantize

TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")


def _weight(rows: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # rows of different magnitudes and an offset, so scales and mins differ across rows and sub-blocks
    return (rng.standard_normal((rows, k)) * rng.uniform(0.2, 3.0, (rows, 1)) + rng.uniform(-1, 1, (rows, 1))
            ).astype(np.float32)


def _linear(groups) -> QuantLinear:
    return (QuantLinear.int4(groups) if isinstance(groups, Int4Groups) else QuantLinear.int5(groups)
            if isinstance(groups, Int5Groups) else QuantLinear.int8h(groups))


def test_each_type_unpacks_to_the_narrowest_tiles_that_hold_it_exactly():
    kinds = {qtype: _linear(kquant_groups_from_gguf(quantize(_weight(32, 256, 2), qtype), qtype, (32, 256))).kind
             for qtype in TYPES}
    assert kinds == {"Q4_K": "int4", "Q5_K": "int5", "Q5_0": "int5", "Q5_1": "int5", "Q6_K": "int8h"}


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels see it: rounded to int8 per group of 32 (scale max |x| / 127), in float64."""
    g = x.double().view(x.shape[0], -1, 32)
    scale = g.abs().amax(-1, keepdim=True) / 127
    return (torch.round(g / scale.clamp_min(1e-30)) * scale).view_as(x)


@pytest.mark.parametrize("qtype", TYPES)
def test_kquant_blocks_unpack_to_exactly_what_gguf_dequantizes(qtype):
    w = _weight(40, 512, 0)
    raw = quantize(w, qtype)
    ref = dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float32)
    groups = kquant_groups_from_gguf(raw, qtype, (40, 512))
    assert torch.equal(groups.dequantize(), torch.from_numpy(ref))
    # the reference quantizer made valid, useful blocks: within a fraction of each row's spread
    spread = w.max(1, keepdims=True) - w.min(1, keepdims=True)
    assert (np.abs(ref - w) <= spread * {"Q4_K": 0.1, "Q5_0": 0.05}.get(qtype, 0.04)).all()
    with pytest.raises(ValueError):
        kquant_groups_from_gguf(raw, qtype, (40, 256))


@pytest.mark.parametrize("rows", [1, 5])
def test_kquant_gemv_matches_the_dequantized_weight_times_the_rounded_activations(rows):
    n, k = 80, 512   # 80 rows: three tiles of 32 (an odd count), the last one padded
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32))
    xq = _int8_rounded(x)
    for seed, qtype in enumerate(TYPES):
        raw = quantize(_weight(n, k, 10 + seed), qtype)
        ref_w = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float32))
        lin = _linear(kquant_groups_from_gguf(raw, qtype, (n, k)))
        y = lin.fn(x)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        exact = xq @ ref_w.double().T   # the integer sums are exact; only float32 scaling rounds
        assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item()), qtype
        plain = F.linear(x, ref_w)      # and the activation rounding moves the result only a little
        assert torch.allclose(y, plain, rtol=0.02, atol=0.02 * plain.abs().max().item()), qtype
        assert torch.equal(lin.big(x), plain)   # large batches run the exact float32 weight


def test_a_fused_linear_of_q4_k_and_q6_k_parts_keeps_every_part_exact():
    # Q4_K_M's fused QKV: Q4_K Q/K rows with Q6_K V rows run as one int8h linear
    k = 256
    q4 = kquant_groups_from_gguf(quantize(_weight(48, k, 3), "Q4_K"), "Q4_K", (48, k))
    q6 = kquant_groups_from_gguf(quantize(_weight(24, k, 4), "Q6_K"), "Q6_K", (24, k))
    fused = Int8HalfGroups.cat([q4, q6])
    assert torch.equal(fused.dequantize(), torch.cat([q4.dequantize(), q6.dequantize()]))
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((3, k)).astype(np.float32))
    y = QuantLinear.int8h(fused).fn(x)
    assert torch.allclose(y[:, :48], QuantLinear.int4(q4).fn(x), rtol=1e-5, atol=1e-4)
    exact = _int8_rounded(x) @ fused.dequantize().double().T
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


def test_kquant_gemv_sums_without_integer_overflow_at_the_extreme_codes():
    # Q6_K's codes at -32 and Q5's at 31 with activations at +-127: the int16 pair sums at their largest
    k = 64
    for code in (-32, 31, 127, -128):
        w = Int8HalfGroups(torch.full((32, k), code, dtype=torch.int8), torch.full((32, k // 16), 0.5),
                           torch.zeros(32, k // 32))
        x = torch.full((1, k), -3.0)
        assert torch.allclose(QuantLinear.int8h(w, dense=False).fn(x), F.linear(x, w.dequantize())), code
    for code in (31, 16, 15):   # the Q5 tiles: 8 pairs of 2 * 31 * 127 would pass int16; and the fifth bit alone
        w5 = Int5Groups(torch.full((32, k), code, dtype=torch.uint8), torch.full((32, k // 32), 0.5),
                        torch.zeros(32, k // 32))
        for x in (torch.full((2, k), -3.0), torch.full((1, k), 3.0)):
            assert torch.equal(QuantLinear.int5(w5, dense=False).fn(x), F.linear(x, w5.dequantize())), code


@pytest.fixture(scope="module")
def q4_k_m_models(gguf_path, tmp_path_factory):
    from gpu.model import LlamaModel

    path = tmp_path_factory.mktemp("kquants") / "smollm2-q4_k_m.gguf"
    counts = requantize(gguf_path, path, "Q4_K_M")
    native = LlamaModel.from_path(path, progress=False, weights="auto")
    return counts, native, LlamaModel.from_path(path, progress=False)


def test_a_q4_k_m_model_runs_its_k_quants_low_bit_and_agrees_with_its_float32_path(q4_k_m_models, tok):
    from bench.quality import DEFAULT_TEXT, compare

    counts, native, reference = q4_k_m_models
    # the embedded model's hidden size 576 is no multiple of 256: only ffn_down (input 1536) is a K-quant,
    # the rest falls back as llama.cpp's does (Q5_0; the tied embedding Q8_0)
    assert set(counts) == {"F32", "Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    kinds = {(lay.down.kind, lay.qkv.kind, lay.gate_up.kind) for lay in native.layers}
    # Q4_K downs on the Q4 tiles, Q6_K on Q8h, Q5_0 on Q5 (a fused QKV with a Q8_0 V on Q8h)
    assert {d for d, _, _ in kinds} == {"int4", "int8h"} and {g for _, _, g in kinds} == {"int5"}
    assert {q for _, q, _ in kinds} == {"int5", "int8h"}
    ids = tok.encode(DEFAULT_TEXT.read_text(encoding="utf-8"))[:129]
    res = compare(reference, native, ids, chunk_tokens=128, candidate_by_decode=True)
    assert native.weights_mode == "native" and res["tokens"] == 128
    assert res["top1_agreement"] >= 0.9, res
    assert res["ppl_candidate"] <= 1.05 * res["ppl_reference"], res


def test_the_one_call_decode_of_a_q4_k_m_model_matches_its_op_by_op_decode(q4_k_m_models):
    from gpu.model import DENSE_MIN_TOKENS, kv_pool_shape

    _, m, _ = q4_k_m_models
    ids = list(range(300, 340))
    tables, lengths = [[0, 1, 2], [3, 4, 5], [6, 7, 8]], [40, 17, 31]
    kv = torch.zeros(kv_pool_shape(m.config, 9, 16))
    for table, n in zip(tables, lengths):
        m.prefill(kv, ids[:n], table)
    kv_op = kv.clone()
    one_call = m.decode(kv, [7, 8, 9], lengths, tables)
    # each layer in its own form within a role: Q4_K and Q6_K downs, QKV on Q5 or (with a Q8_0 V) on Q8h
    forms = [{(codes.shape[2], codes.shape[3]) for codes in m._stacked[role][0]} for role in (2, 3, 4, 5)]
    assert forms == [{(10, 64), (8, 128)}, {(10, 64)}, {(10, 64)}, {(8, 64), (8, 128)}], forms
    assert {lay.down.kind for lay in m.layers} == {"int4", "int8h"}   # the linears themselves are unchanged
    stacked, m._stacked = m._stacked, ()   # () = "not applicable": the op-by-op path, on the same kernels
    m.dense_min_tokens = 1 << 30
    try:
        op_by_op = m.decode(kv_op, [7, 8, 9], lengths, tables)
    finally:
        m._stacked, m.dense_min_tokens = stacked, DENSE_MIN_TOKENS
    assert torch.allclose(kv[0], kv_op[0], atol=1e-4)
    p, q = one_call.log_softmax(-1), op_by_op.log_softmax(-1)
    assert torch.equal(one_call.argmax(-1), op_by_op.argmax(-1))
    assert (p.exp() * (p - q)).sum(-1).max() < 0.02


def _portable_linear(rows_codegen, x: np.ndarray, tiles: dict, **options) -> np.ndarray:
    """``x`` times a tiled weight through ``rows_codegen`` compiled with ``x86=False`` (the portable IR a host without
    AVX2 runs), one row and one group at a time: float32 ``[M, tiles' rows]``."""
    import numba
    from numba.core import types
    from numba.extending import intrinsic

    from gpu import lowbit_cpu as lb

    @intrinsic
    def portable_group(typingctx, codes_addr, x_addr, scale_addr, min_addr, fx, sx, acc_addr):
        sig = types.void(types.intp, types.intp, types.intp, types.intp, types.float32, types.float32, types.intp)

        def codegen(context, builder, signature, args):
            ca, xa, sa, ma, fx_, sx_, aa = args
            rows_codegen(builder, ca, sa, ma, [(xa, fx_, sx_, aa)], x86=False, **options)
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

    y = np.empty((x.shape[0], tiles["tiles"].shape[0] * lb.TILE_ROWS), np.float32)
    portable(x, *(tiles[name].numpy() for name in ("tiles", "tile_scale", "tile_min")), y)
    return y


def test_the_portable_q8h_loop_gives_the_same_integer_sums_as_the_one_the_host_runs():
    # hosts without AVX2 compile the Q8h loop's products in portable IR: check it here against the host's
    # (pmaddubsw + pmaddwd on AVX2). Unit scales, integer activations with a 127 in every group (so the int8
    # rounding is exact) and codes over the whole int8 range: both must give the exact integer dot products.
    from gpu import lowbit_cpu as lb

    rng = np.random.default_rng(8)
    n, k = 64, 96
    codes = torch.from_numpy(rng.integers(-128, 128, (n, k)).astype(np.int8))
    codes[0], codes[1] = -128, 127
    w = Int8HalfGroups(codes, torch.ones(n, k // 16), torch.zeros(n, k // 32))
    x = rng.integers(-127, 128, (3, k)).astype(np.float32)
    x[:, ::32] = 127.0
    x[1] = -x[1]
    tiles = lb.q8h_tiles(w.codes, w.scale, w.min)
    exact = torch.from_numpy(x).double() @ codes.double().T
    host = lb.q8h_linear(torch.from_numpy(x), n, **tiles)   # rows 0, 1 as a pair, row 2 alone
    assert torch.equal(host.double(), exact)
    assert torch.equal(torch.from_numpy(_portable_linear(lb._q8h_rows_codegen, x, tiles)).double(), exact)


def test_the_portable_q5_loop_gives_the_same_integer_sums_as_the_one_the_host_runs():
    # as the Q8h check above: the Q5 loop's pair products in portable IR against the host's (pmaddubsw), codes
    # over 0..31 (every fifth-bit position set somewhere), integer activations with a 127 in every group
    from gpu import lowbit_cpu as lb

    rng = np.random.default_rng(13)
    n, k = 64, 96
    codes = torch.from_numpy(rng.integers(0, 32, (n, k)).astype(np.uint8))
    codes[0], codes[1] = 31, 16
    w = Int5Groups(codes, torch.ones(n, k // 32), torch.zeros(n, k // 32))
    x = rng.integers(-127, 128, (3, k)).astype(np.float32)
    x[:, ::32] = 127.0
    x[2] = 127.0
    tiles = lb.q5_tiles(w.codes, w.scale, w.min)
    exact = torch.from_numpy(x).double() @ codes.double().T
    host = lb.q5_linear(torch.from_numpy(x), n, **tiles)   # rows 0, 1 as a pair, row 2 alone
    assert torch.equal(host.double(), exact)
    portable = _portable_linear(lb._q4_rows_codegen, x, tiles, fifth=True)
    assert torch.equal(torch.from_numpy(portable).double(), exact)
