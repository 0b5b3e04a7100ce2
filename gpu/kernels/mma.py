"""Tensor-core tiles for numba.cuda kernels: one warp-wide ``mma.sync.m16n8k16`` (bf16 or f16 in, f32
accumulate) as a device function, and the linear layer built on it.

| name | what |
|---|---|
| ``mma_tile.cu`` | the CUDA C++ device functions ``pd_mma_{bf16,f16}_m16n8k16`` (inline PTX ``mma.sync``), linked into every kernel that uses :func:`mma_fn` |
| :func:`mma_fn` | ``mma(scratch, warp, lane, a0..a3, b0, b1, c0..c3) -> (d0, d1, d2, d3)`` for a storage kind |
| :func:`mma_linear` | ``y = x @ W.T`` for ``x [M, K]``, ``W [N, K]``: a warp per 16 x (8 * nsub) tile of ``y``, split-K over ``target_ctas`` |
| :func:`link_ptx` | the linked PTX (and cubin size) of a kernel that uses the tile, compiled and linked without a GPU |

numba.cuda exposes no tensor-core instruction, so the MMA itself is CUDA C++ (``mma_tile.cu``: fragment layout in
its header) that numba links into the kernel (``cuda.jit(link=[...])``; NVRTC compiles it, nvJitLink links it).
Under numba's CUDA simulator the same call runs a Python twin with the hardware's fragment ownership: each lane
posts its six fragment registers to shared memory, the block synchronises, and every lane computes its four D
values from the registers of the lanes that own each A and B element. So the simulator checks the kernels' packing
of fragments, not only their arithmetic. The twin sums the 16 products of a k-step in float64 and adds them to C;
the hardware's order within a k-step is its own (both accumulate k-steps in float32, in the kernel's order).
"""
from __future__ import annotations

import functools
import pathlib

import torch

from . import _runtime as rt
from .matmul import plan_split_k

CU_PATH = pathlib.Path(__file__).with_name("mma_tile.cu")
KINDS = {torch.bfloat16: "bf16", torch.float16: "f16"}
DEVICE_SHAPE = (4, 4)  # warps per CTA, 8-column subtiles per warp: a CTA owns 16 rows x 128 columns of y
SIM_SHAPE = (2, 2)  # 64 threads, 16 x 32: simulator-sized

cuda = None  # numba.cuda, bound on first use (a module global: see paged_attention.py)


def _half_to_float(bits: int, kind: str) -> float:
    """16 stored bits of ``kind`` ("bf16" or "f16") as a Python float (the simulator twin's decode)."""
    import numpy as np  # noqa: PLC0415

    if kind == "bf16":
        return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])
    return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])


def _sim_mma(kind: str):
    """The simulator twin of ``pd_mma_<kind>_m16n8k16`` (see the module docstring); every thread of the block
    must call it the same number of times (it synchronises the block twice)."""

    def element(scratch, warp, lane, reg, half):
        return _half_to_float((int(scratch[warp, lane, reg]) >> (16 * half)) & 0xFFFF, kind)

    def a_at(scratch, warp, r, k):  # A[r][k]: lane (r % 8) * 4 + (k % 8) // 2, register (r >= 8) + 2 (k >= 8)
        return element(scratch, warp, (r % 8) * 4 + (k % 8) // 2, (r >= 8) + 2 * (k >= 8), k % 2)

    def b_at(scratch, warp, k, n):  # B[k][n]: lane n * 4 + (k % 8) // 2, register 4 + (k >= 8)
        return element(scratch, warp, n * 4 + (k % 8) // 2, 4 + (k >= 8), k % 2)

    def mma(scratch, warp, lane, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        import numpy as np  # noqa: PLC0415

        for i, reg in enumerate((a0, a1, a2, a3, b0, b1)):
            scratch[warp, lane, i] = reg
        cuda.syncthreads()
        g, t = lane // 4, lane % 4
        out = []
        for r, n, c in ((g, 2 * t, c0), (g, 2 * t + 1, c1), (g + 8, 2 * t, c2), (g + 8, 2 * t + 1, c3)):
            step = sum(a_at(scratch, warp, r, k) * b_at(scratch, warp, k, n) for k in range(16))
            out.append(np.float32(np.float32(c) + np.float32(step)))
        cuda.syncthreads()
        return out[0], out[1], out[2], out[3]

    return mma


@functools.lru_cache(maxsize=None)
def mma_fn(kind: str):
    """The warp MMA device function for storage ``kind`` (``"bf16"`` or ``"f16"``).

    ``mma(scratch, warp, lane, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)``: ``a*``/``b*`` are
    uint32 fragment registers (two 16-bit values each, see ``mma_tile.cu``), ``c*``/``d*`` float32.
    ``scratch`` is a shared uint32 array ``[warps, 32, 6]`` (used by the simulator twin only; a kernel allocates
    :func:`scratch_shape`), ``warp`` the warp's index in the block, ``lane`` its lane. On a device the call is
    one ``mma.sync`` and needs the kernel linked with :data:`CU_PATH` (:func:`jit_kernel`).
    """
    global cuda
    cuda = rt._cuda()
    if kind not in ("bf16", "f16"):
        raise ValueError(f"mma tiles take bf16 or f16 storage, not {kind!r}")
    if rt.simulator():
        return cuda.jit(device=True)(_sim_mma(kind))
    from numba import types  # noqa: PLC0415

    sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))
    ext = cuda.declare_device(f"pd_mma_{kind}_m16n8k16", sig)

    @cuda.jit(device=True, inline=True)
    def mma(scratch, warp, lane, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return ext(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    return mma


def scratch_shape(warps: int) -> tuple[int, int, int]:
    """The shared scratch a kernel using :func:`mma_fn` allocates: ``(warps, 32, 6)`` under the simulator, a
    placeholder ``(1, 1, 1)`` on a device (the hardware exchanges fragments itself)."""
    return (warps, 32, 6) if rt.simulator() else (1, 1, 1)


def jit_kernel(fn):
    """``cuda.jit`` for a kernel calling :func:`mma_fn`: linked with ``mma_tile.cu`` on a device."""
    global cuda
    cuda = rt._cuda()
    return cuda.jit(fn) if rt.simulator() else cuda.jit(link=[str(CU_PATH)])(fn)


@functools.lru_cache(maxsize=None)
def pack_fn():
    """``pack(lo, hi) -> uint32``: two 16-bit values (int16 bits of bf16/f16) as one fragment register, ``lo`` in
    the low half."""
    global cuda
    cuda = rt._cuda()
    from numba import int32, uint32  # noqa: PLC0415

    @cuda.jit(device=True, inline=True)
    def pack(lo, hi):
        return uint32(uint32(int32(lo) & 0xFFFF) | (uint32(int32(hi) & 0xFFFF) << uint32(16)))

    return pack


@functools.lru_cache(maxsize=None)
def pair_fn():
    """``pair(a, row, k, rows) -> uint32``: ``a[row, k]`` (low half) and ``a[row, k + 1]`` (high half) of an
    int16-bits array, or 0 for ``row >= rows`` (a tile's padding rows)."""
    global cuda
    cuda = rt._cuda()
    from numba import uint32  # noqa: PLC0415

    pack = pack_fn()

    @cuda.jit(device=True, inline=True)
    def pair(a, row, k, rows):
        if row >= rows:
            return uint32(0)
        return pack(a[row, k], a[row, k + 1])

    return pair


def linear_kernel_source(warps: int, nsub: int, kind: str):
    """The Python source function of the MMA linear kernel (before ``cuda.jit``): also what :func:`link_ptx`
    compiles. ``kernel(x, w, partial, k_per_split)``: ``x [M, K]``, ``w [N, K]`` int16 bits of ``kind``,
    ``partial [splits, M, N]`` float32; grid ``(ceil(N / (8 nsub warps)), ceil(M / 16), splits)``, block
    ``32 * warps``."""
    global cuda
    cuda = rt._cuda()
    from numba import float32, uint32  # noqa: PLC0415

    mma, pair = mma_fn(kind), pair_fn()
    SCR = scratch_shape(warps)
    COLS = 8 * nsub

    def kernel(x, w, partial, k_per_split):
        M, K = x.shape
        N = w.shape[0]
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        r0 = cuda.blockIdx.y * 16 + g  # this lane's two rows of y: r0 and r0 + 8
        n0 = (cuda.blockIdx.x * warps + warp) * COLS
        k_lo = cuda.blockIdx.z * k_per_split
        k_hi = min(K, k_lo + k_per_split)
        scratch = cuda.shared.array(SCR, uint32)
        acc = cuda.local.array((nsub, 4), float32)  # acc[j]: this lane's c0..c3 of subtile j
        for j in range(nsub):
            for q in range(4):
                acc[j, q] = 0.0
        for k0 in range(k_lo, k_hi, 16):
            ka = k0 + 2 * t
            a0, a1 = pair(x, r0, ka, M), pair(x, r0 + 8, ka, M)
            a2, a3 = pair(x, r0, ka + 8, M), pair(x, r0 + 8, ka + 8, M)
            for j in range(nsub):
                n = n0 + 8 * j + g  # B[k][n] = W[n][k]: a row of W is a column of B
                b0, b1 = pair(w, n, ka, N), pair(w, n, ka + 8, N)
                d = mma(scratch, warp, lane, a0, a1, a2, a3, b0, b1, acc[j, 0], acc[j, 1], acc[j, 2], acc[j, 3])
                for q in range(4):
                    acc[j, q] = d[q]
        s = cuda.blockIdx.z
        for j in range(nsub):
            col = n0 + 8 * j + 2 * t
            for q in range(4):
                r = r0 + 8 * (q // 2)
                n = col + q % 2
                if r < M and n < N:
                    partial[s, r, n] = acc[j, q]

    return kernel


@functools.lru_cache(maxsize=None)
def _linear_kernel(warps: int, nsub: int, kind: str):
    return jit_kernel(linear_kernel_source(warps, nsub, kind))


def mma_linear(x: torch.Tensor, w: torch.Tensor, *, target_ctas: int | None = None,
               shape: tuple[int, int] | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``y = x @ w.T`` on tensor cores (``F.linear`` without bias).

    Args:
        x: ``[M, K]`` bfloat16 or float16 (CUDA tensor; CPU tensor under the simulator).
        w: ``[N, K]``, the same dtype and device; ``K`` a multiple of 16.
        target_ctas: split K into chunks until the grid has about this many CTAs (decode-sized ``M``); None/0:
            no split. Partials are float32 and summed in a fixed order (deterministic).
        shape: ``(warps per CTA, 8-column subtiles per warp)``; default :data:`DEVICE_SHAPE` (:data:`SIM_SHAPE`
            under the simulator).
        out_dtype: the result's dtype (default ``x.dtype``); accumulation is float32 either way.
    Returns:
        ``[M, N]``.
    Raises:
        TypeError: other dtypes, or ``x`` and ``w`` of different dtypes. ValueError: shapes.
    """
    if x.dtype not in KINDS or w.dtype != x.dtype:
        raise TypeError(f"mma_linear takes bfloat16 or float16 x and w of one dtype; got {x.dtype}, {w.dtype}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.shape[1] % 16:
        raise ValueError(f"mma_linear: x [M, K] and w [N, K] with K a multiple of 16; got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")
    warps, nsub = shape or (SIM_SHAPE if rt.simulator() else DEVICE_SHAPE)
    M, K = x.shape
    N = w.shape[0]
    splits, k_per_split = plan_split_k(M, N, K, 16, 8 * nsub * warps, 16, target_ctas)
    partial = torch.zeros((splits, M, N), dtype=torch.float32, device=x.device)
    kernel = _linear_kernel(warps, nsub, KINDS[x.dtype])
    grid = (-(-N // (8 * nsub * warps)), -(-M // 16), splits)
    xa = rt.as_kernel_array(x.contiguous().view(torch.int16))
    wa = rt.as_kernel_array(w.contiguous().view(torch.int16))
    with rt.on_device_of(x):
        kernel[grid, 32 * warps, rt.launch_stream(x)](xa, wa, rt.as_kernel_array(partial), k_per_split)
    return partial.sum(0).to(out_dtype or x.dtype)


def link_ptx(source, signature: tuple, cc: tuple[int, int] = (9, 0)) -> tuple[str, int]:
    """Compile a kernel source function that calls :func:`mma_fn` and link it with ``mma_tile.cu`` for
    ``sm_<cc>``, with no GPU: numba -> LTO-IR, NVRTC -> LTO-IR, nvJitLink -> PTX and cubin.

    Returns ``(ptx, cubin_bytes)``. Needs numba-cuda with the CUDA 12 toolkit wheels (``pip install
    'numba-cuda[cu12]'``, the ``test`` extra); raises ImportError without them.
    """
    from cuda.core import Linker, LinkerOptions, ObjectCode, Program, ProgramOptions  # noqa: PLC0415

    arch = f"sm_{cc[0]}{cc[1]}"
    ltoir, _ = rt._cuda().compile(source, signature, cc=cc, output="ltoir", device=False, abi="numba")
    tile = Program(CU_PATH.read_text(), "c++", ProgramOptions(arch=arch, link_time_optimization=True,
                                                               relocatable_device_code=True)).compile("ltoir")
    objs = (ObjectCode.from_ltoir(ltoir, name="kernel"), tile)
    ptx = Linker(*objs, options=LinkerOptions(arch=arch, link_time_optimization=True, ptx=True)).link("ptx").code
    cubin = Linker(*objs, options=LinkerOptions(arch=arch, link_time_optimization=True)).link("cubin").code
    return (ptx.decode() if isinstance(ptx, bytes) else ptx), len(cubin)
