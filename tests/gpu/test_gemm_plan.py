"""``gpu.model.gemm_plan``: how a native prefill runs a float32 GEMM so that a row's bits never depend on the rows
beside it or on the thread count. Its promise is checked at row counts it did not try, on this machine's MKL, and
its fallbacks on GEMMs built to break each property (bits that change with the number of rows, or with threads).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu.model import GEMM_PROBE_ROWS, PREFILL_BLOCK_ROWS, gemm_plan, gemm_rows, torch_threads

# the embedded model's linear shapes (in, out): QKV, attention output, gate-up, down, the output projection
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
UNTRIED = (1, 5, 12, 40, 77, 130, 513)


def _reference(fn, x: torch.Tensor) -> torch.Tensor:
    """Every row in its own zero-padded PREFILL_BLOCK_ROWS-row call on one thread: the bits the plan promises."""
    pad = x.new_zeros(PREFILL_BLOCK_ROWS - 1, x.shape[1])
    with torch_threads(1):
        return torch.cat([fn(torch.cat([x[i:i + 1], pad]))[:1] for i in range(x.shape[0])])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_plan_gives_every_row_its_bits_alone_at_counts_it_never_tried(shape, threads):
    k, n = shape
    g = torch.Generator().manual_seed(3)
    w = torch.randn(n, k, generator=g)

    def fn(x):
        return F.linear(x, w)

    before = torch.get_num_threads()
    whole, used = gemm_plan(fn, k, threads)
    assert torch.get_num_threads() == before and used in (1, threads)
    counts = UNTRIED if n < 10_000 else UNTRIED[:4]
    x = torch.randn(max(counts), k, generator=g)
    ref = _reference(fn, x)
    for m in counts:
        assert torch.equal(gemm_rows(fn, x[:m], whole, used), ref[:m]), (shape, threads, whole, used, m)


def test_a_gemm_whose_bits_change_with_the_number_of_rows_runs_in_blocks():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(4))

    def by_count(x):   # another summation order from 40 rows on, as a library may pick another kernel there
        return F.linear(x, w) if x.shape[0] < 40 else F.linear(x.double(), w.double()).float()

    assert gemm_plan(by_count, 96, 1) == (False, 1)
    assert max(GEMM_PROBE_ROWS) >= 40
    # the blocks themselves keep a row's bits (the last one zero-padded): no machine here falls back to them
    x = torch.randn(max(UNTRIED), 96, generator=torch.Generator().manual_seed(6))
    ref = _reference(by_count, x)
    for m in UNTRIED:
        assert torch.equal(gemm_rows(by_count, x[:m], False, 1), ref[:m]), m


def test_a_model_plans_each_weight_shape_apart():
    """``LlamaModel._gemm_rows`` keys its plans by (out, in, threads): a linear of another output size but the same
    input size (the QKV and the output projection, say) finds its own plan, not the first one's."""
    from types import SimpleNamespace

    from gpu.model import LlamaModel

    g = torch.Generator().manual_seed(7)
    w, w_other = torch.randn(64, 96, generator=g), torch.randn(48, 96, generator=g)

    def by_count(x):   # as above: another summation order from 40 rows on
        return F.linear(x, w_other) if x.shape[0] < 40 else F.linear(x.double(), w_other.double()).float()

    model = LlamaModel.__new__(LlamaModel)
    model._gemm_threads, model._gemm_plans = 0, {}
    plain = SimpleNamespace(out_features=64, big=lambda x: F.linear(x, w))
    other = SimpleNamespace(out_features=48, big=by_count)
    x = torch.randn(max(UNTRIED), 96, generator=g)
    with torch_threads(1):
        model._gemm_rows(plain, x)
        for m in UNTRIED:
            assert torch.equal(model._gemm_rows(other, x[:m]), _reference(by_count, x[:m])), m
    assert sorted(model._gemm_plans) == [(48, 96, 1), (64, 96, 1)]


def test_a_gemm_whose_bits_change_with_threads_runs_on_one_thread():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(5))

    def by_threads(x):
        y = F.linear(x, w)
        return y if torch.get_num_threads() == 1 else y + 1e-6 * y.abs()

    assert gemm_plan(by_threads, 96, 2) == (False, 1)
    assert gemm_plan(by_threads, 96, 1)[1] == 1
