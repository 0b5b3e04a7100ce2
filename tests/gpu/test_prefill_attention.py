"""``lowbit_cpu.attend_rows``, the per-row causal attention of a native prefill over the paged KV pool, against a
float64 reference computed from the same pool: grouped-query heads, scattered and shared-prefix block tables,
rows of several sequences packed in one call, positions past a cached prefix, and sliding windows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu import lowbit_cpu as lb

H, HKV, D, BT = 4, 2, 32, 4


def _reference(q, pool_k, pool_v, tables, seq, positions, window, scale) -> np.ndarray:
    """Row by row in float64: softmax(q K^T * scale) V over the row's own keys."""
    out = np.empty(q.shape, np.float64)
    for r, (s, p) in enumerate(zip(seq, positions)):
        first = max(0, p + 1 - window) if window else 0
        keys = np.arange(first, p + 1)
        slots = tables[s][keys // BT] * BT + keys % BT
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
    lb.attend_rows(q, pool_k, pool_v, tables, BT, seq, positions, window, D ** -0.5, out)
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
    lb.attend_rows(q, pool_k, pool_v, tables, BT, seq, positions, 0, D ** -0.5, out)
    for r in range(len(seq)):
        alone = np.empty((1, H, D), np.float32)
        lb.attend_rows(q[r:r + 1], pool_k, pool_v, tables[seq[r]:seq[r] + 1], BT, np.zeros(1, np.int64),
                       positions[r:r + 1], 0, D ** -0.5, alone)
        assert np.array_equal(alone[0], out[r]), r
