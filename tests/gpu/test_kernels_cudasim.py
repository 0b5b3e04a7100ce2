"""The numba.cuda kernels (gpu/kernels) against their torch references: under numba's CUDA simulator on CPU
(in CI), and the same tests on a real GPU when there is one (marker ``gpu``).

The simulator must be switched on before numba is first imported, and it then holds for the whole process, so
the simulated runs happen in a child pytest (``test_every_kernel_passes_under_the_cuda_simulator`` runs this
file with ``NUMBA_ENABLE_CUDASIM=1 -k simulated``); the rest of the session never sees the simulator. In the
parent, the ``simulated`` variants are skipped (they ran in the child) and the ``cuda`` variants run only with a
CUDA device. The simulator runs every GPU thread as a Python thread, so the simulated sizes are tiny: 2-3
sequences, head_dim 8/16, blocks of 4 tokens, 16-32 threads per CTA.
"""
from __future__ import annotations

import inspect
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from gpu.kernels import (TargetCtasTuner, copy_blocks, copy_blocks_ref, gather_blocks, linear_ref,
                         paged_attention_decode, paged_attention_decode_ref, paged_attention_decode_torch,
                         plan_split_k, plan_splits, scatter_blocks, tiled_linear)
from gpu.kernels.kv_copy import rows_view
from gpu.kernels.mma import mma_linear
from gpu.kernels.mma_attention import mma_attention_decode
from gpu.kernels.paged_attention import pick_tile_tokens
from tests.gpu.conftest import run_simulated_child

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parents[2]


# With a GPU the kernels must run on it: if numba cannot reach a device torch sees, the tests fail (loudly)
# rather than skip.
GPU = not SIM and torch.cuda.is_available()
DEVICES = [
    pytest.param("simulated", marks=pytest.mark.skipif(
        not SIM, reason="simulated in the NUMBA_ENABLE_CUDASIM=1 child of "
                        "test_every_kernel_passes_under_the_cuda_simulator")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs a CUDA device")]),
]


@pytest.fixture(params=DEVICES)
def dev(request) -> str:
    """The torch device the kernels' tensors live on: CPU under the simulator, else the GPU."""
    return "cpu" if request.param == "simulated" else "cuda"


def _rand(*shape, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def _decode_case(dev, *, H=4, Hkv=2, D=8, bt=4, num_blocks=9, lens=(11, 6), dtype=torch.float32, seed=0):
    """A pool with scattered, non-overlapping block tables and ragged lengths (one sequence per length)."""
    B = len(lens)
    q = _rand(B, H, D, seed=seed, dtype=dtype, device=dev)  # q: [B, H, D]
    kv = _rand(2, num_blocks, bt, Hkv, D, seed=seed + 1, dtype=dtype, device=dev)  # kv: [2, NB, bt, Hkv, D]
    need = [-(-n // bt) for n in lens]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + 2)).tolist()
    assert sum(need) <= num_blocks
    width = max(need) + 1  # one padding entry past every sequence's blocks: must never be read
    tables, at = [], 0
    for n in need:
        row = perm[at:at + n]
        at += n
        tables.append(row + [-7] * (width - n))  # -7: reading it would be out of range
    tables_t = torch.tensor(tables, dtype=torch.int32, device=dev)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    return q, kv, tables_t, lens_t


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    err = (got.float().cpu() - want.float().cpu()).abs().max().item()
    assert err <= tol, f"max abs error {err:.3g} > {tol:.3g}"


# -------------------------------------------------------------------------------------------------- attention

def test_paged_attention_matches_the_reference_for_gqa_and_ragged_lengths(dev):
    q, kv, tables, lens = _decode_case(dev)
    out = paged_attention_decode(q, kv, tables.clamp(min=0) if dev == "cuda" else tables, lens,
                                 tile_tokens=4, threads=16 if dev == "cpu" else None)
    assert out.shape == (2, 4, 8) and out.dtype == torch.float32
    _close(out, paged_attention_decode_ref(q, kv, tables.clamp(min=0), lens), 2e-5)


@pytest.mark.parametrize("target_ctas", [8, 1000])
def test_paged_attention_split_over_several_ctas_equals_one_cta(dev, target_ctas):
    # 2 seqs x 2 kv heads = 4 CTAs without a split; target 8 -> 2 splits, 1000 -> one tile (4 tokens) per
    # split: the 6-token sequence then leaves its last splits empty, which the combine step must ignore.
    q, kv, tables, lens = _decode_case(dev, lens=(13, 6), num_blocks=10)
    tables = tables.clamp(min=0)
    want = paged_attention_decode_ref(q, kv, tables, lens)
    out = paged_attention_decode(q, kv, tables, lens, target_ctas=target_ctas, tile_tokens=4,
                                 threads=16 if dev == "cpu" else None)
    _close(out, want, 2e-5)


@pytest.mark.parametrize("H,Hkv", [(3, 3), (4, 1)], ids=["mha", "mqa"])
def test_paged_attention_handles_no_grouping_and_a_single_kv_head(dev, H, Hkv):
    q, kv, tables, lens = _decode_case(dev, H=H, Hkv=Hkv, D=16, lens=(5, 9, 1), num_blocks=7, seed=3)
    tables = tables.clamp(min=0)
    out = paged_attention_decode(q, kv, tables, lens, target_ctas=12, tile_tokens=4,
                                 threads=16 if dev == "cpu" else None)
    _close(out, paged_attention_decode_ref(q, kv, tables, lens), 2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_reads_half_precision_pools_and_returns_their_dtype(dev, dtype):
    q, kv, tables, lens = _decode_case(dev, dtype=dtype, seed=5)
    tables = tables.clamp(min=0)
    kw = dict(target_ctas=8, tile_tokens=4, threads=16 if dev == "cpu" else None)
    want = paged_attention_decode_ref(q, kv, tables, lens)
    exact = torch.empty(q.shape, dtype=torch.float32, device=dev)
    paged_attention_decode(q, kv, tables, lens, out=exact, **kw)
    _close(exact, want, 2e-5)  # fp32 math over exactly the stored values
    out = paged_attention_decode(q, kv, tables, lens, **kw)
    assert out.dtype == dtype  # ...rounded once to the input dtype: within one ulp of it
    _close(out, want, float(want.abs().max()) * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10))


def test_paged_attention_of_a_whole_pool_reads_the_layer_asked_for(dev):
    q, kv1, tables, lens = _decode_case(dev, seed=7)
    tables = tables.clamp(min=0)
    pool = torch.stack([torch.full_like(kv1, float("nan")), kv1])  # layer 0 is poison
    out = paged_attention_decode(q, pool, tables, lens, layer=1, tile_tokens=4,
                                 threads=16 if dev == "cpu" else None)
    _close(out, paged_attention_decode_ref(q, kv1, tables, lens), 2e-5)


def test_paged_attention_agrees_with_the_torch_sdpa_path(dev):
    q, kv, tables, lens = _decode_case(dev, lens=(3, 12), num_blocks=8, D=16, seed=11)
    tables = tables.clamp(min=0)
    _close(paged_attention_decode(q, kv, tables, lens, tile_tokens=4, threads=16 if dev == "cpu" else None),
           paged_attention_decode_torch(q, kv, tables, lens), 2e-5)


# simulated only: on a device block ids are not checked (it would sync the stream)
@pytest.mark.parametrize("dev", DEVICES[:1], indirect=True)
def test_paged_attention_rejects_a_block_id_outside_the_pool(dev):
    q, kv, tables, lens = _decode_case(dev)
    bad = tables.clone()
    bad[1, 0] = kv.shape[1]
    with pytest.raises(ValueError, match="block ids must be in"):
        paged_attention_decode(q, kv, bad, lens, threads=16)
    with pytest.raises(ValueError, match="seq_lens must be in"):
        paged_attention_decode(q, kv, tables, torch.tensor([0, 3], dtype=torch.int32), threads=16)


# ---------------------------------------------------------------------------------------------------- KV copy

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_moves_scattered_blocks_of_every_layer_and_nothing_else(dev, dtype):
    src = _rand(3, 2, 7, 4, 2, 8, seed=1, dtype=dtype, device=dev)  # [L, 2, NB, bt, Hkv, D]
    dst = _rand(3, 2, 6, 4, 2, 8, seed=2, dtype=dtype, device=dev)
    want = dst.clone()
    src_ids, dst_ids = [6, 0, 3, 3], [1, 5, 0, 2]  # a source may be copied twice
    copy_blocks_ref(src, want, src_ids, dst_ids)
    copy_blocks(src, dst, src_ids, dst_ids, threads=16 if dev == "cpu" else None)
    assert torch.equal(dst, want)


def test_gather_then_scatter_round_trips_through_a_staging_buffer(dev):
    pool = _rand(2, 2, 5, 4, 2, 4, seed=3, device=dev)
    staging = gather_blocks(pool, [4, 1], threads=16 if dev == "cpu" else None)
    assert staging.shape == (2, 2, 2, 4, 2, 4) and torch.equal(staging, pool[:, :, [4, 1]])
    other = torch.zeros_like(pool)
    scatter_blocks(staging, other, [0, 3], threads=16 if dev == "cpu" else None, target_ctas=64)
    assert torch.equal(other[:, :, [0, 3]], pool[:, :, [4, 1]])
    assert float(other[:, :, [1, 2, 4]].abs().sum()) == 0.0


def test_copy_blocks_rejects_a_repeated_destination_and_ids_outside_the_pools(dev):
    src = _rand(1, 2, 3, 4, 1, 4, seed=4, device=dev)
    dst = torch.zeros_like(src)
    with pytest.raises(ValueError, match="listed twice"):
        copy_blocks(src, dst, [0, 1], [2, 2])
    with pytest.raises(ValueError, match="must be in"):
        copy_blocks(src, dst, [3], [0])
    copy_blocks(src, dst, [], [])  # nothing to do is fine
    assert float(dst.abs().sum()) == 0.0


# ----------------------------------------------------------------------------------------------------- matmul

@pytest.mark.parametrize("target_ctas", [None, 100])
def test_tiled_linear_matches_torch_on_ragged_shapes_with_and_without_split_k(dev, target_ctas):
    x = _rand(5, 13, seed=5, device=dev)  # [M, K]: no dimension a multiple of a tile
    w = _rand(11, 13, seed=6, device=dev)  # [N, K]
    y = tiled_linear(x, w, target_ctas=target_ctas)
    assert y.shape == (5, 11) and y.dtype == torch.float32
    _close(y, linear_ref(x, w), 1e-5)


def test_tiled_linear_reads_bf16_and_accumulates_in_fp32(dev):
    x = _rand(4, 9, seed=7, dtype=torch.bfloat16, device=dev)
    w = _rand(6, 9, seed=8, dtype=torch.bfloat16, device=dev)
    y = tiled_linear(x, w, target_ctas=8, out_dtype=torch.float32)
    _close(y, linear_ref(x, w), 1e-4)


# ---------------------------------------------------------------------------------- tensor-core (MMA) tiles

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("target_ctas", [None, 8])
def test_mma_linear_matches_the_float32_product_on_ragged_rows_and_columns(dev, dtype, target_ctas):
    x = _rand(19, 48, seed=11, dtype=dtype, device=dev)  # [M, K]: M past one 16-row tile, K three k-steps
    w = _rand(37, 48, seed=12, dtype=dtype, device=dev)  # [N, K]: N not a multiple of a warp's columns
    y = mma_linear(x, w, target_ctas=target_ctas, out_dtype=torch.float32)
    assert y.shape == (19, 37) and y.dtype == torch.float32
    _close(y, linear_ref(x, w), 1e-4)  # products of 16-bit values are exact in fp32: only the sum order differs


@pytest.mark.parametrize("H,Hkv,D,lens", [(4, 2, 16, (19, 6)), (3, 1, 32, (33, 1)), (16, 1, 16, (21,))],
                         ids=["gqa", "mqa", "group-of-16"])
def test_mma_attention_matches_the_exact_answer_within_the_bf16_rounding_of_p(dev, H, Hkv, D, lens):
    q, kv, tables, lens_t = _decode_case(dev, H=H, Hkv=Hkv, D=D, bt=4, num_blocks=16, lens=lens,
                                         dtype=torch.bfloat16)
    out = mma_attention_decode(q, kv, tables, lens_t)
    assert out.shape == (len(lens), H, D) and out.dtype == torch.float32
    _close(out, paged_attention_decode_ref(q, kv, tables, lens_t), 8e-3)  # P is bf16 in the PV product


# ------------------------------------------------------------------------------------------- real sizes (GPU)

@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("target_ctas", [None, 264, 2048])
def test_paged_attention_at_llama3_8b_head_shapes_matches_sdpa_on_the_gpu(target_ctas):
    # H 32, Hkv 8, D 128, blocks of 16, ragged lengths up to 2000, fp16 pool
    q, kv, tables, lens = _decode_case("cuda", H=32, Hkv=8, D=128, bt=16, num_blocks=1100,
                                       lens=(2000, 1, 17, 512, 1999, 64, 300, 1024), dtype=torch.float16)
    tables = tables.clamp(min=0)
    out = torch.empty(q.shape, dtype=torch.float32, device="cuda")
    paged_attention_decode(q, kv, tables, lens, target_ctas=target_ctas, max_seq_len=2000, out=out)
    want = paged_attention_decode_ref(q, kv, tables, lens)  # float64 over the same values
    _close(out, want, 1e-4)
    sdpa = paged_attention_decode_torch(q, kv, tables, lens)  # the torch backend, fp16 all the way
    _close(out, sdpa, 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_kv_copy_and_matmul_at_llama_3_2_1b_sizes_on_the_gpu():
    src = _rand(16, 2, 300, 16, 8, 64, seed=1, dtype=torch.bfloat16, device="cuda")
    dst = torch.zeros(16, 2, 200, 16, 8, 64, dtype=torch.bfloat16, device="cuda")
    ids_s = torch.randperm(300)[:128].tolist()
    ids_d = torch.randperm(200)[:128].tolist()
    copy_blocks(src, dst, ids_s, ids_d)
    want = torch.zeros_like(dst)
    copy_blocks_ref(src, want, ids_s, ids_d)
    assert torch.equal(dst, want)
    x = _rand(64, 2048, seed=2, dtype=torch.float16, device="cuda")
    w = _rand(3072, 2048, seed=3, dtype=torch.float16, device="cuda")
    for target in (None, 264):
        y = tiled_linear(x, w, target_ctas=target, out_dtype=torch.float32)
        _close(y, linear_ref(x, w), 5e-2)  # |y| ~ 45: 5e-2 is ~1e-3 relative (fp32 sums in another order)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_mma_tiles_at_llama_3_2_1b_and_llama3_8b_shapes_match_cublas_and_sdpa_on_the_gpu():
    for m in (1, 64, 512):
        x = _rand(m, 2048, seed=4, dtype=torch.bfloat16, device="cuda")
        w = _rand(8192, 2048, seed=5, dtype=torch.bfloat16, device="cuda")
        for target in (None, 264):
            y = mma_linear(x, w, target_ctas=target, out_dtype=torch.float32)
            _close(y, torch.matmul(x.float(), w.float().T), 5e-2)  # cuBLAS in fp32 over the same bf16 values
    q, kv, tables, lens = _decode_case("cuda", H=32, Hkv=8, D=128, bt=16, num_blocks=1100,
                                       lens=(2000, 1, 17, 512, 1999, 64, 300, 1024), dtype=torch.bfloat16)
    out = mma_attention_decode(q, kv, tables.clamp(min=0), lens)
    _close(out, paged_attention_decode_torch(q, kv, tables.clamp(min=0), lens), 2e-2)  # SDPA in bf16


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_numba_reaches_the_cuda_device_torch_sees():
    from gpu.kernels import cuda_device_available, kernels_available

    assert cuda_device_available() and kernels_available(), (
        "numba.cuda.is_available() is False: is numba-cuda installed and matching the driver? "
        "(python -c 'from numba import cuda; cuda.detect()')")


# ------------------------------------------------------------------------------------------- pure logic (CPU)

def test_split_plans_reach_the_target_without_empty_trailing_splits():
    assert plan_splits(64, 8, 4096, 32, None) == (1, 4096)
    assert plan_splits(64, 8, 4096, 32, 256) == (1, 4096)  # 512 CTAs already
    # 8 CTAs; 264 wants 33 splits of 124 tokens, rounded up to whole tiles: 32 splits of 128 (4 tiles each)
    assert plan_splits(1, 8, 4096, 32, 264) == (32, 128)
    splits, per = plan_splits(3, 2, 1000, 16, 100)
    assert per % 16 == 0 and (splits - 1) * per < 1000 <= splits * per and splits * 6 >= 90
    assert plan_splits(2, 2, 5, 4, 1000) == (2, 4)  # never more splits than tiles
    assert plan_split_k(16, 3072, 2048, 32, 64, 16, None) == (1, 2048)
    splits, per = plan_split_k(16, 3072, 2048, 32, 64, 16, 264)  # 48 tiles -> 6 K chunks
    assert (splits, per) == (6, 352) and (splits - 1) * per < 2048 <= splits * per
    with pytest.raises(ValueError):
        plan_splits(0, 1, 1, 1, None)


def test_the_attention_tile_shrinks_to_fit_static_shared_memory():
    assert pick_tile_tokens(64, 3, 32) == 32
    assert pick_tile_tokens(128, 4, 32) == 32
    tile = pick_tile_tokens(256, 8, 64)
    assert tile == 16 and 4 * (8 * 256 + tile * 513 + 8 * tile + 24) <= 48 * 1024


def test_pool_rows_are_copied_with_the_widest_integer_carrier():
    assert rows_view(torch.zeros(2, 2, 3, 4, 2, 8, dtype=torch.bfloat16)).dtype == torch.int64
    assert rows_view(torch.zeros(2, 2, 3, 1, 1, 3, dtype=torch.float16)).dtype == torch.int16
    assert rows_view(torch.zeros(2, 2, 3, 4, 2, 8)).shape == (4, 3, 32)  # fp32 rows of 64 floats as int64


def test_the_target_ctas_tuner_keeps_the_fastest_candidate_and_caches_it_per_gpu(tmp_path):
    cache = tmp_path / "tune.json"
    costs = {0: 3.0, 132: 1.0, 264: 2.0, 528: -1}
    calls = []

    def timer(fn):
        fn()
        if costs[calls[-1]] < 0:
            raise RuntimeError("launch failed")
        return costs[calls[-1]]

    tuner = TargetCtasTuner(cache, device_name="H200", timer=timer)
    assert tuner.best("decode", "b1_s4096", calls.append, [0, 132, 264, 528]) == 132
    assert tuner.measured["H200|decode|b1_s4096"] == {0: 3.0, 132: 1.0, 264: 2.0}
    assert json.loads(cache.read_text()) == {"H200|decode|b1_s4096": 132}
    calls.clear()
    again = TargetCtasTuner(cache, device_name="H200", timer=timer)
    assert again.best("decode", "b1_s4096", calls.append, [0, 132]) == 132 and calls == []  # from the file
    other_gpu = TargetCtasTuner(cache, device_name="A100", timer=timer)
    assert other_gpu.cached("decode", "b1_s4096") is None
    assert other_gpu.best("decode", "b1_s4096", calls.append, [0, 264]) == 264
    assert json.loads(cache.read_text()) == {"H200|decode|b1_s4096": 132, "A100|decode|b1_s4096": 264}


def test_kernels_compile_to_ptx_for_hopper():
    """Typing and lowering for the real target (the simulator runs plain Python, so it cannot catch e.g. a
    shared-array shape that is not a constant). Needs NVVM (the ``test`` extra: numba-cuda with the CUDA 12
    toolkit wheels), not a GPU; without it this fails rather than skips."""
    if SIM:
        pytest.skip("the simulator cannot compile PTX")
    from numba import cuda, types

    @cuda.jit(device=True, inline=True)  # as the kernels' device functions are
    def twice(x):
        return 2 * x

    def probe(a):
        a[0] = twice(a[0])

    try:
        cuda.compile_ptx(probe, (types.float32[::1],), cc=(9, 0))
    except Exception as exc:  # noqa: BLE001 - say what to install
        pytest.fail(f"no CUDA compiler for numba ({type(exc).__name__}: {exc}); install the test extra "
                    f"(pip install -e '.[test]': numba-cuda[cu12])")
    from gpu.kernels import kv_copy, matmul, paged_attention

    f32, f16, i16, i32, i64 = types.float32, types.float16, types.int16, types.int32, types.int64

    def arr(t, nd, layout="A"):
        return types.Array(t, nd, layout)

    for kind, t in [("float", f32), ("float", f16), ("bf16", i16)]:
        k = paged_attention._decode_kernel(128, 4, 32, 128, 16, kind, kind)
        cuda.compile_ptx(k.py_func, (arr(t, 3), arr(t, 4), arr(t, 4), arr(i32, 2), arr(i32, 1), types.float64,
                                     types.int64, arr(f32, 3), arr(f32, 4), arr(f32, 4)), cc=(9, 0))
        lin, _ = matmul._linear_kernel(*matmul.DEVICE_TILES, kind, kind)
        cuda.compile_ptx(lin.py_func, (arr(t, 2), arr(t, 2), arr(f32, 3), types.int64), cc=(9, 0))
    cuda.compile_ptx(paged_attention._combine_kernel(128).py_func, (arr(f32, 4), arr(f32, 4), arr(f32, 3)),
                     cc=(9, 0))
    cuda.compile_ptx(kv_copy._copy_kernel(256).py_func, (arr(i64, 3), arr(i64, 3), arr(i64, 1), arr(i64, 1)),
                     cc=(9, 0))


def test_the_mma_tiles_link_into_ptx_with_tensor_core_instructions_for_hopper():
    """numba kernel -> LTO-IR, mma_tile.cu -> LTO-IR (NVRTC), nvJitLink -> PTX and cubin for sm_90: the linear
    and attention kernels' PTX holds ``mma.sync`` (one per 8 columns per k-step; QK^T and PV), with no GPU."""
    if SIM:
        pytest.skip("the simulator cannot compile PTX")
    from numba import types

    from gpu.kernels.mma import DEVICE_SHAPE, link_ptx, linear_kernel_source
    from gpu.kernels.mma_attention import attention_kernel_source

    i16, i32, f32 = types.int16, types.int32, types.float32

    def arr(t, nd):
        return types.Array(t, nd, "A")

    for kind in ("bf16", "f16"):
        ptx, cubin = link_ptx(linear_kernel_source(*DEVICE_SHAPE, kind), (arr(i16, 2), arr(i16, 2), arr(f32, 3),
                                                                           types.int64))
        assert ptx.count(f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32") == DEVICE_SHAPE[1]
        assert ".target sm_90" in ptx and cubin > 0
    ptx, cubin = link_ptx(attention_kernel_source(128, 4, 16), (arr(i16, 3), arr(i16, 4), arr(i16, 4), arr(i32, 2),
                                                                arr(i32, 1), types.float64, arr(f32, 3)))
    # QK^T: two 8-key tiles x 8 k-steps of 16 dims; PV: 16 tiles of 8 dims
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 2 * 8 + 16
    assert ".local" not in ptx and cubin > 0  # fragments stay in registers: no spill to local memory


# ------------------------------------------------------------------------------------------------- the driver

def simulated_cases() -> int:
    """How many tests the simulator child must pass: each test of this module taking ``dev`` once per
    combination of its parametrize marks (its ``dev`` parameter contributes the one simulated case)."""
    n = 0
    for name, fn in globals().items():
        if name.startswith("test_") and callable(fn) and "dev" in inspect.signature(fn).parameters:
            cases = 1
            for mark in getattr(fn, "pytestmark", []):
                if mark.name == "parametrize" and mark.args[0] != "dev":
                    cases *= len(mark.args[1])
            n += cases
    return n


@pytest.mark.timeout(280)
def test_every_kernel_passes_under_the_cuda_simulator():
    if SIM:
        pytest.skip("this is the simulator child")
    print(run_simulated_child(HERE, simulated_cases(), timeout_s=260))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what the benchmark says without a device")
def test_the_gpu_benchmark_says_plainly_that_there_is_no_cuda_device():
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--quick"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no CUDA device" in proc.stderr and "nothing was measured" in proc.stderr


@pytest.mark.timeout(200)
def test_the_gpu_benchmark_runs_every_simulable_section_at_toy_sizes(tmp_path):
    """``--smoke``: the benchmark's code paths (all but CUDA IPC) on CPU under the simulator, so a GPU run
    does not discover a typo in them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "NUMBA_"))}
    env["NUMBA_ENABLE_CUDASIM"] = "1"
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--smoke", "--json", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "FAILED" not in proc.stdout, proc.stdout[-4000:]
    rows = json.loads(out.read_text())
    for section in ("attention", "matmul", "engine"):
        assert rows[section] and not any("error" in r for r in rows[section]), rows[section]
    assert all(r["max abs err"] < 0.05 for r in rows["attention"])
    assert all(r["rel err"] < 0.01 for r in rows["matmul"])
