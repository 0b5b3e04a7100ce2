"""A shared-memory tiled matmul in numba.cuda for one projection, ``y = x @ W.T`` (``F.linear``, no bias),
with split-K: the kernel the benchmark holds against cuBLAS (``torch.matmul``) to see what a hand tile buys.

Algorithm: the classic two-level tiling of CUTLASS's / Volkov's SGEMM (see also Simon Boehm's "How to Optimize
a CUDA Matmul Kernel"): a CTA owns a ``BM x BN`` tile of ``y``; for each ``BK`` slice of the reduction dim it
stages ``x[BM, BK]`` and ``W[BN, BK]`` in shared memory (transposed, so the inner loop reads rows), and each
of its ``(BM / TM) * (BN / TN)`` threads accumulates a ``TM x TN`` register micro-tile with outer products.
Accumulation is float32 for fp32/fp16/bf16 inputs. There are no tensor-core (mma.sync / wgmma) instructions
here: numba.cuda does not expose them, so against cuBLAS this is an fp32-CUDA-core kernel, and the benchmark
says so next to its numbers.

Split-K (``target_ctas``): decode-shaped projections have few rows (the batch), so ``M/BM * N/BN`` tiles can
be fewer than the GPU's SMs; the K range is then cut into ``splits`` chunks, one CTA per (tile, chunk), each
writing a float32 partial ``[splits, M, N]`` that one ``sum(0)`` reduces (deterministic, unlike atomics).
"""
from __future__ import annotations

import functools

import torch

from . import _runtime as rt
from ._loads import kernel_view, kind_of, load_fn

cuda = None  # numba.cuda, bound on first use (a module global: see paged_attention.py)

DEVICE_TILES = (32, 64, 16, 4, 4)  # BM, BN, BK, TM, TN: 128 threads, 6.3 KiB shared
SIM_TILES = (8, 8, 4, 2, 2)  # 16 threads: simulator-sized


def plan_split_k(M: int, N: int, K: int, bm: int, bn: int, bk: int,
                 target_ctas: int | None) -> tuple[int, int]:
    """``(splits, k_per_split)``: the fewest K chunks that bring ``ceil(M/bm) * ceil(N/bn) * splits`` up to
    ``target_ctas`` (1 if None/0 or already there), each a multiple of ``bk``, none empty."""
    if min(M, N, K, bm, bn, bk) < 1:
        raise ValueError(f"plan_split_k: sizes must be >= 1 (M={M}, N={N}, K={K}, tiles {bm}x{bn}x{bk})")
    tiles = -(-M // bm) * -(-N // bn)
    k_tiles = -(-K // bk)
    splits = 1 if not target_ctas or target_ctas <= tiles else -(-int(target_ctas) // tiles)
    splits = max(1, min(splits, k_tiles))
    k_per_split = -(-k_tiles // splits) * bk
    return -(-K // k_per_split), k_per_split


@functools.lru_cache(maxsize=None)
def _linear_kernel(BM: int, BN: int, BK: int, TM: int, TN: int, a_kind: str, w_kind: str):
    global cuda
    cuda = rt._cuda()
    from numba import float32  # noqa: PLC0415

    if BM % TM or BN % TN:
        raise ValueError(f"tile {BM}x{BN} is not a multiple of the micro-tile {TM}x{TN}")
    ld_a = load_fn(a_kind)
    ld_w = load_fn(w_kind)
    TX = BN // TN  # threads along N
    TY = BM // TM  # threads along M
    NT = TX * TY
    BMP, BNP = BM + 1, BN + 1  # padded shared rows; shapes must be plain constants, not expressions
    TMN = TM * TN

    @cuda.jit
    def linear(a, w, c, k_per_split):
        # grid (ceil(N/BN), ceil(M/BM), splits), block NT threads.
        # a: [M, K]; w: [N, K]; c: [splits, M, N] f32 (partial sums of K chunk blockIdx.z)
        M = a.shape[0]
        K = a.shape[1]
        N = w.shape[0]
        bn = cuda.blockIdx.x * BN
        bm = cuda.blockIdx.y * BM
        sp = cuda.blockIdx.z
        k0 = sp * k_per_split
        k1 = min(K, k0 + k_per_split)
        tid = cuda.threadIdx.x
        tx = tid % TX
        ty = tid // TX
        zero = float32(0.0)
        a_s = cuda.shared.array((BK, BMP), float32)  # a_s: [BK, BM] x tile, transposed (+1 pad)
        w_s = cuda.shared.array((BK, BNP), float32)  # w_s: [BK, BN] W tile, transposed (+1 pad)
        acc = cuda.local.array(TMN, float32)  # acc: [TM, TN] micro-tile
        ra = cuda.local.array(TM, float32)
        rb = cuda.local.array(TN, float32)
        for r in range(TMN):
            acc[r] = zero
        for kt in range(k0, k1, BK):
            for i in range(tid, BM * BK, NT):  # consecutive threads: consecutive k (coalesced rows)
                r = i // BK
                cc = i - r * BK
                v = zero
                if bm + r < M and kt + cc < k1:
                    v = ld_a(a[bm + r, kt + cc])
                a_s[cc, r] = v
            for i in range(tid, BN * BK, NT):
                r = i // BK
                cc = i - r * BK
                v = zero
                if bn + r < N and kt + cc < k1:
                    v = ld_w(w[bn + r, kt + cc])
                w_s[cc, r] = v
            cuda.syncthreads()
            for cc in range(BK):
                for ii in range(TM):
                    ra[ii] = a_s[cc, ty + ii * TY]
                for jj in range(TN):
                    rb[jj] = w_s[cc, tx + jj * TX]
                for ii in range(TM):
                    for jj in range(TN):
                        acc[ii * TN + jj] += ra[ii] * rb[jj]
            cuda.syncthreads()
        for ii in range(TM):
            row = bm + ty + ii * TY
            if row < M:
                for jj in range(TN):
                    col = bn + tx + jj * TX  # consecutive threads: consecutive columns (coalesced)
                    if col < N:
                        c[sp, row, col] = acc[ii * TN + jj]

    return linear, NT


def tiled_linear(x: torch.Tensor, w: torch.Tensor, *, target_ctas: int | None = None,
                 tiles: tuple[int, int, int, int, int] | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ w.T`` with the numba tiled kernel (+ split-K).

    Args:
        x: ``[M, K]`` activations; w: ``[N, K]`` weights (``F.linear`` layout); float32/float16/bfloat16,
            any strides.
        target_ctas: CTAs to aim for; K is split when the output tiles alone are fewer (:func:`plan_split_k`).
        tiles: ``(BM, BN, BK, TM, TN)``; default :data:`DEVICE_TILES` (:data:`SIM_TILES` in the simulator).
        out_dtype: result dtype (default ``x.dtype``); accumulation is float32.
    Returns:
        ``[M, N]``.
    Raises:
        ValueError: shapes that do not chain, or tensors on two devices.
    """
    rt.require_kernels()
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"tiled_linear: x must be [M, K] and w [N, K]; got {list(x.shape)}, {list(w.shape)}")
    if x.device != w.device:
        raise ValueError(f"tiled_linear: x on {x.device}, w on {w.device}")
    M, K = x.shape
    N = w.shape[0]
    BM, BN, BK, TM, TN = tiles or (SIM_TILES if rt.simulator() else DEVICE_TILES)
    splits, k_per_split = plan_split_k(M, N, K, BM, BN, BK, target_ctas)
    kernel, NT = _linear_kernel(BM, BN, BK, TM, TN, kind_of(x), kind_of(w))
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    A = rt.as_kernel_array
    with rt.on_device_of(x):
        kernel[(-(-N // BN), -(-M // BM), splits), NT, rt.launch_stream(x)](
            A(kernel_view(x)), A(kernel_view(w)), A(part), k_per_split)
    y = part[0] if splits == 1 else part.sum(0)
    return y.to(out_dtype or x.dtype)
