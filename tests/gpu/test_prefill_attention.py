"""``attention_cpu.attend_rows``, the per-row causal attention of a native prefill over the paged KV pool: against a
float64 reference computed from the same pool (grouped-query heads, scattered and shared-prefix block tables, rows
of several sequences packed in one call, positions past a cached prefix, sliding windows, the embedded model's
head shapes), a row's bits alone, among other rows, and with any part of its prompt cached, and a query with a
NaN."""
from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from gpu import attention_cpu as ac

H, HKV, D, BT = 4, 2, 32, 4


def _reference(q, pool_k, pool_v, tables, seq, positions, window, scale, bt=BT) -> np.ndarray:
    """Row by row in float64: softmax(q K^T * scale) V over the row's own keys."""
    H, HKV = q.shape[1], pool_k.shape[1]
    out = np.empty(q.shape, np.float64)
    for r, (s, p) in enumerate(zip(seq, positions)):
        first = max(0, p + 1 - window) if window else 0
        keys = np.arange(first, p + 1)
        slots = tables[s][keys // bt] * bt + keys % bt
        k = pool_k[slots].astype(np.float64).repeat(H // HKV, axis=1)   # [S, H, D]
        v = pool_v[slots].astype(np.float64).repeat(H // HKV, axis=1)
        w = torch.softmax(torch.from_numpy(np.einsum("hd,shd->hs", q[r].astype(np.float64), k) * scale), -1)
        out[r] = np.einsum("hs,shd->hd", w.numpy(), v)
    return out


@pytest.mark.parametrize("window", [0, 5])
def test_attend_rows_matches_a_float64_reference_per_row(window):
    rng = np.random.default_rng(3)
    slots = 24 * BT
    pool_k = rng.standard_normal((slots, HKV, D)).astype(np.float32)
    pool_v = rng.standard_normal((slots, HKV, D)).astype(np.float32)
    # sequence 0: positions 0..10 from scratch; 1: a cached prefix of 9 then 9..21; 2: one token at 13; block
    # ids out of order, sequence 2 sharing sequence 1's first blocks (a prefix-cache hit)
    tables = np.array([[7, 2, 11, 0, 0, 0], [5, 1, 9, 3, 20, 14], [5, 1, 9, 17, 5, 5]], np.int64)
    seq = np.array([0] * 11 + [1] * 13 + [2], np.int64)
    positions = np.array(list(range(11)) + list(range(9, 22)) + [13], np.int64)
    q = rng.standard_normal((len(seq), H, D)).astype(np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    ac.attend_rows(q, pool_k, pool_v, tables, BT, seq, positions, window, D ** -0.5, out)
    ref = _reference(q, pool_k, pool_v, tables, seq, positions, window, D ** -0.5)
    assert np.abs(out - ref).max() < 1e-5


def test_attend_rows_gives_a_row_the_same_bits_alone_and_among_others():
    rng = np.random.default_rng(4)
    pool_k = rng.standard_normal((16 * BT, HKV, D)).astype(np.float32)
    pool_v = rng.standard_normal((16 * BT, HKV, D)).astype(np.float32)
    tables = np.array([[3, 8, 1, 12], [0, 2, 4, 6]], np.int64)
    q = rng.standard_normal((9, H, D)).astype(np.float32)
    seq, positions = np.array([1, 0, 0, 0, 1, 1, 0, 1, 0], np.int64), np.array([2, 7, 15, 0, 9, 14, 3, 5, 11],
                                                                                np.int64)
    out = np.empty(q.shape, np.float32)
    ac.attend_rows(q, pool_k, pool_v, tables, BT, seq, positions, 0, D ** -0.5, out)
    for r in range(len(seq)):
        alone = np.empty((1, H, D), np.float32)
        ac.attend_rows(q[r:r + 1], pool_k, pool_v, tables[seq[r]:seq[r] + 1], BT, np.zeros(1, np.int64),
                       positions[r:r + 1], 0, D ** -0.5, alone)
        assert np.array_equal(alone[0], out[r]), r


def _model_shaped(rng, n_blocks=64):
    """SmolLM2-135M's attention shape (9 query heads, 3 KV heads of 64) over a pool of 16-token blocks."""
    h, hkv, d, bt = 9, 3, 64, 16
    pool_k = rng.standard_normal((n_blocks * bt, hkv, d)).astype(np.float32)
    pool_v = rng.standard_normal((n_blocks * bt, hkv, d)).astype(np.float32)
    return h, d, bt, pool_k, pool_v


@pytest.mark.parametrize("window", [0, 37])
def test_attend_rows_at_the_models_head_shape_matches_a_float64_reference(window):
    rng = np.random.default_rng(5)
    h, d, bt, pool_k, pool_v = _model_shaped(rng)
    tables = rng.permutation(64).reshape(2, 32).astype(np.int64)
    # sequence 0: 41 new rows past a cached prefix of 459 (a multi-round turn); sequence 1: 70 rows from scratch
    seq = np.array([0] * 41 + [1] * 70, np.int64)
    positions = np.array(list(range(459, 500)) + list(range(70)), np.int64)
    q = (2 * rng.standard_normal((len(seq), h, d))).astype(np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    ac.attend_rows(q, pool_k, pool_v, tables, bt, seq, positions, window, d ** -0.5, out)
    ref = _reference(q, pool_k, pool_v, tables, seq, positions, window, d ** -0.5, bt)
    assert np.abs(out - ref).max() < 1e-5


@pytest.mark.parametrize("window", [0, 21])
def test_a_prompts_rows_get_the_same_bits_with_any_part_of_it_cached(window):
    """One 75-token prompt attended whole, then as a cached prefix of k tokens plus the rest for every k, packed
    after another sequence's rows: each row's bits never change (its tile lanes, its slot among the four queries
    of a pass and the keys beside it all move with k)."""
    rng = np.random.default_rng(6)
    h, d, bt, pool_k, pool_v = _model_shaped(rng)
    tables = np.array([list(range(3, 8)), [40, 41, 0, 0, 0]], np.int64)
    q = rng.standard_normal((75, h, d)).astype(np.float32)
    whole = np.empty(q.shape, np.float32)
    ac.attend_rows(q, pool_k, pool_v, tables, bt, np.zeros(75, np.int64), np.arange(75), window, d ** -0.5, whole)
    other = rng.standard_normal((5, h, d)).astype(np.float32)
    for k in range(75):
        rows = np.concatenate([other, q[k:]])
        seq = np.array([1] * 5 + [0] * (75 - k), np.int64)
        pos = np.concatenate([np.arange(10, 15), np.arange(k, 75)]).astype(np.int64)
        out = np.empty(rows.shape, np.float32)
        ac.attend_rows(rows, pool_k, pool_v, tables, bt, seq, pos, window, d ** -0.5, out)
        assert np.array_equal(out[5:], whole[k:]), k


def test_supported_head_dims():
    assert ac.supported(64) and ac.supported(128) and ac.supported(80)
    assert not ac.supported(72) and not ac.supported(0)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (10, 2, 16), (8, 2, 128)])
@pytest.mark.parametrize("first,length", [(0, 1), (0, 16), (0, 17), (0, 300), (37, 300), (290, 300)])
def test_attend_decode_row_matches_a_float64_reference(heads, kv_heads, dim, first, length):
    """A decode step's row (``attend_decode_row``, as ``lowbit_cpu.decode_layers`` calls it): one query per head
    over keys first..length-1 through a scattered block table; groups of 1, 2, 3 and 5 query heads per KV head (5:
    two passes of QUERIES)."""
    rng = np.random.default_rng(length + heads)
    bt = 16
    table = rng.permutation(24).astype(np.int64)
    pool_k, pool_v = (rng.standard_normal((24 * bt, kv_heads, dim)).astype(np.float32) for _ in range(2))
    q = (2 * rng.standard_normal((heads, dim))).astype(np.float32)
    out = np.full((heads, dim), np.nan, np.float32)
    ac.attend_decode_row(q, pool_k, pool_v, table, bt, first, length, dim ** -0.5, out)
    window = length - first if first else 0
    ref = _reference(q[None], pool_k, pool_v, table[None], np.zeros(1, np.int64), [length - 1], window,
                     dim ** -0.5, bt)
    assert np.abs(out - ref[0]).max() < 1e-5


def test_a_query_with_a_nan_gets_nan_not_plausible_numbers():
    """A NaN in a query (an overflowed activation upstream) makes that head's scores NaN: its output is NaN, as
    the float64 reference's is, in a prefill row and in a decode row, and the other heads and rows keep their bits
    (the kernel's exp clamps scores below -87, but a NaN is not below -87)."""
    rng = np.random.default_rng(8)
    h, d, bt, pool_k, pool_v = _model_shaped(rng, 8)
    tables = np.arange(8, dtype=np.int64)[None]
    q = rng.standard_normal((40, h, d)).astype(np.float32)
    seq, positions = np.zeros(40, np.int64), np.arange(40, dtype=np.int64)
    clean = np.empty(q.shape, np.float32)
    ac.attend_rows(q, pool_k, pool_v, tables, bt, seq, positions, 0, d ** -0.5, clean)
    q[[0, 21, 39], [4, 0, 8], [0, 17, 63]] = np.nan
    out = np.empty(q.shape, np.float32)
    ac.attend_rows(q, pool_k, pool_v, tables, bt, seq, positions, 0, d ** -0.5, out)
    nan = np.isnan(q).any(axis=2)
    assert np.isnan(out[nan]).all()
    assert np.array_equal(out[~nan], clean[~nan])
    row = np.empty((h, d), np.float32)
    ac.attend_decode_row(q[21], pool_k, pool_v, tables[0], bt, 0, 22, d ** -0.5, row)
    assert np.isnan(row[0]).all() and np.isfinite(row[1:]).all()


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_a_float16_pool_attends_with_the_bits_of_its_float32_image(heads, kv_heads, dim):
    """``kv_cache_dtype`` float16 (numba gets the pool's bits as uint16): every kernel widens each K/V exactly, so
    a prefill's rows (``attend_rows``) and a decode row (``attend_decode_row``, and ``lowbit_cpu._attend`` for head
    dims the tiles do not take) over the float16 pool equal, bit for bit, the same calls over a float32 pool holding
    its values; and ``from_f32`` rounds as torch's ``.to(torch.float16)`` does (the prefill writes with torch, the
    decode kernel with ``from_f32``: a key must not depend on which wrote it)."""
    from gpu import lowbit_cpu

    rng = np.random.default_rng(dim + heads)
    bt, blocks = 16, 24
    half = [(3 * rng.standard_normal((blocks * bt, kv_heads, dim))).astype(np.float16) for _ in range(2)]
    image = [h.astype(np.float32) for h in half]
    bits = [h.view(np.uint16) for h in half]
    table = rng.permutation(blocks).astype(np.int64)
    q = rng.standard_normal((40, heads, dim)).astype(np.float32)
    seq, positions = np.zeros(40, np.int64), np.arange(300, 340, dtype=np.int64)
    outs = []
    for pool_k, pool_v in (image, bits):
        rows = np.empty(q.shape, np.float32)
        ac.attend_rows(q, pool_k, pool_v, table[None], bt, seq, positions, 0, dim ** -0.5, rows)
        row = np.empty((heads, dim), np.float32)
        ac.attend_decode_row(q[0], pool_k, pool_v, table, bt, 0, 341, dim ** -0.5, row)
        scalar = np.empty((heads, dim), np.float32)
        lowbit_cpu._attend(q[0], pool_k, pool_v, table, bt, 0, 341, np.float32(dim ** -0.5),
                           np.empty(341, np.float32), scalar)
        outs.append((rows, row, scalar))
    assert all(np.array_equal(a, b) for a, b in zip(*outs))
    assert np.abs(outs[0][1] - outs[0][2]).max() < 1e-4   # the tiles and the scalar loop agree

    @numba.njit
    def round_all(x, like):
        out = np.empty(x.shape, np.uint16)
        for i in range(x.shape[0]):
            out[i] = ac.from_f32(x[i], like[0])
        return out

    x = np.concatenate([(rng.standard_normal(4096) * 10.0 ** rng.integers(-8, 5, 4096)).astype(np.float32),
                        np.array([65519.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 0.0, -0.0], np.float32)])
    want = torch.from_numpy(x).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(round_all(x, bits[0][0, 0]), want)
