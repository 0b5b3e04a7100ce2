"""KV block gather/scatter in numba.cuda: every layer, K and V, of a list of blocks in ONE launch.

Used by the KV transport (``gpu/cuda_ipc.py``) to move a request's blocks from the prefill pool to the decode
pool, and to pack blocks into / unpack them from a contiguous staging buffer (a cross-device copy). The copy
is bytewise (each pool is viewed with the widest integer type that divides one block's row), so every dtype,
bf16 included, moves exactly. Pool layout (``gpu/model.py``)::

    pool: [num_layers, 2, num_blocks, block_tokens, num_kv_heads, head_dim]   viewed as [L * 2, num_blocks, E]

Grid ``(n_blocks, L * 2, z)``: CTA ``(i, lk, z)`` copies row ``lk`` of block ``src_ids[i]`` to block
``dst_ids[i]``; ``z`` CTAs share one row when ``target_ctas`` asks for more parallelism than
``n_blocks * L * 2`` gives (a one-block request on a 132-SM GPU). Same idea as vLLM's ``copy_blocks`` /
``swap_blocks`` cache kernels, but one launch for all layers instead of one per layer.
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import torch

from . import _runtime as rt

cuda = None  # numba.cuda, bound on first use (a module global: see paged_attention.py)

_CARRIERS = (torch.int64, torch.int32, torch.int16, torch.uint8)


@functools.lru_cache(maxsize=None)
def _copy_kernel(NT: int):
    global cuda
    cuda = rt._cuda()

    @cuda.jit
    def copy_rows(src, dst, src_ids, dst_ids):
        # grid (n, LK, Z), block NT threads.
        # src: [LK, num_blocks_src, E]; dst: [LK, num_blocks_dst, E] (same integer carrier dtype)
        # src_ids, dst_ids: [n] block ids
        i = cuda.blockIdx.x
        lk = cuda.blockIdx.y
        s = src_ids[i]
        d = dst_ids[i]
        E = src.shape[2]
        step = NT * cuda.gridDim.z
        for e in range(cuda.blockIdx.z * NT + cuda.threadIdx.x, E, step):
            dst[lk, d, e] = src[lk, s, e]

    return copy_rows


def rows_view(pool: torch.Tensor) -> torch.Tensor:
    """``pool`` ``[L, 2, NB, bt, Hkv, D]`` (or a staging ``[L, 2, n, bt, Hkv, D]``) as ``[L * 2, NB, E]`` in
    the widest integer carrier whose size divides one row's bytes (int64 for any even head_dim in fp16/bf16).
    Raises ValueError if the block and token dims cannot be merged without a copy."""
    if pool.dim() != 6 or pool.shape[1] != 2:
        raise ValueError(f"a KV pool is [num_layers, 2, num_blocks, block_tokens, Hkv, D]; "
                         f"got {list(pool.shape)}")
    L, _, NB = pool.shape[:3]
    try:
        rows = pool.view(L * 2, NB, -1)
    except RuntimeError:
        raise ValueError(f"KV pool with strides {pool.stride()} cannot be viewed as [L*2, blocks, E] "
                         f"without a copy; use a contiguous pool") from None
    row_bytes = rows.shape[2] * rows.element_size()
    for carrier in _CARRIERS:
        size = torch.empty((), dtype=carrier).element_size()
        if row_bytes % size == 0 and (rows.storage_offset() * rows.element_size()) % size == 0:
            try:
                return rows.view(carrier)
            except RuntimeError:
                continue
    return rows.view(torch.uint8)


def _ids_tensor(ids, n_blocks: int, what: str, device: torch.device, unique: bool) -> torch.Tensor:
    """Block ids as an int64 tensor on ``device``; host-side ids are checked (range, repeats)."""
    if isinstance(ids, torch.Tensor) and ids.is_cuda:
        return ids.to(device=device, dtype=torch.int64)  # device ids: the caller vouches for them
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= n_blocks):
        raise ValueError(f"{what} block ids must be in [0, {n_blocks}); got min {arr.min()}, max {arr.max()}")
    if unique and np.unique(arr).size != arr.size:
        raise ValueError(f"a {what} block id is listed twice")
    t = torch.from_numpy(arr.copy())
    return t.to(device, non_blocking=True) if device.type == "cuda" else t


def _launch(src_rows: torch.Tensor, dst_rows: torch.Tensor, sids: torch.Tensor, dids: torch.Tensor,
            threads: int | None, target_ctas: int | None) -> None:
    n = int(sids.shape[0])
    if n == 0:
        return
    LK, E = src_rows.shape[0], src_rows.shape[2]
    NT = int(threads) if threads else (32 if rt.simulator() else 256)
    max_z = -(-E // NT)
    z = 1 if not target_ctas else max(1, min(max_z, -(-int(target_ctas) // (n * LK))))
    A = rt.as_kernel_array
    with rt.on_device_of(dst_rows):
        _copy_kernel(NT)[(n, LK, z), NT, rt.launch_stream(dst_rows)](
            A(src_rows), A(dst_rows), A(sids), A(dids))


def _check_pair(src: torch.Tensor, dst: torch.Tensor, what: str) -> None:
    if src.dtype != dst.dtype or src.shape[0] != dst.shape[0] or src.shape[3:] != dst.shape[3:]:
        raise ValueError(f"{what}: geometry differs: {list(src.shape)} {src.dtype} vs {list(dst.shape)} "
                         f"{dst.dtype} (all but num_blocks must match)")
    if src.device != dst.device:
        raise ValueError(f"{what}: source on {src.device}, destination on {dst.device}; one launch copies "
                         f"within a device (stage across devices with gather_blocks + .to + scatter_blocks)")


def copy_blocks(src_pool: torch.Tensor, dst_pool: torch.Tensor, src_ids: Sequence[int] | torch.Tensor,
                dst_ids: Sequence[int] | torch.Tensor, *, threads: int | None = None,
                target_ctas: int | None = None) -> None:
    """``dst_pool[:, :, dst_ids[i]] = src_pool[:, :, src_ids[i]]`` for every i, in one kernel launch.

    Args:
        src_pool, dst_pool: ``[num_layers, 2, num_blocks, block_tokens, Hkv, D]``, same dtype and geometry
            except num_blocks, same device (for two devices use :func:`gather_blocks` /
            :func:`scatter_blocks`).
        src_ids, dst_ids: equal-length block ids (host sequences are checked; CUDA tensors are trusted).
        threads: threads per CTA (default 256; 32 in the simulator).
        target_ctas: spread each row over more CTAs when there are fewer than this many (block, row) pairs.
    Raises:
        ValueError: mismatched geometry/lengths/devices, ids out of range, or a repeated destination id.
    Source: the block layout of vLLM's PagedAttention; launched on torch's current stream.
    """
    rt.require_kernels()
    _check_pair(src_pool, dst_pool, "copy_blocks")
    dev = dst_pool.device
    sids = _ids_tensor(src_ids, src_pool.shape[2], "source", dev, unique=False)
    dids = _ids_tensor(dst_ids, dst_pool.shape[2], "destination", dev, unique=True)
    if sids.shape != dids.shape:
        raise ValueError(f"copy_blocks: {sids.shape[0]} source ids but {dids.shape[0]} destination ids")
    _launch(rows_view(src_pool), rows_view(dst_pool), sids, dids, threads, target_ctas)


def gather_blocks(pool: torch.Tensor, ids: Sequence[int] | torch.Tensor, *, out: torch.Tensor | None = None,
                  threads: int | None = None, target_ctas: int | None = None) -> torch.Tensor:
    """Pack blocks ``ids`` of ``pool`` into a contiguous ``[num_layers, 2, len(ids), block_tokens, Hkv, D]``
    staging tensor (``out`` if given) on the pool's device, in one launch. Returns the staging tensor."""
    rt.require_kernels()
    dev = pool.device
    sids = _ids_tensor(ids, pool.shape[2], "source", dev, unique=False)
    n = int(sids.shape[0])
    shape = (pool.shape[0], 2, n) + tuple(pool.shape[3:])
    staging = out if out is not None else torch.empty(shape, dtype=pool.dtype, device=dev)
    if tuple(staging.shape) != shape:
        raise ValueError(f"gather_blocks: out is {list(staging.shape)}; expected {list(shape)}")
    _check_pair(pool, staging, "gather_blocks")
    dids = torch.arange(n, dtype=torch.int64, device=dev)
    _launch(rows_view(pool), rows_view(staging), sids, dids, threads, target_ctas)
    return staging


def scatter_blocks(staging: torch.Tensor, pool: torch.Tensor, ids: Sequence[int] | torch.Tensor, *,
                   threads: int | None = None, target_ctas: int | None = None) -> None:
    """Unpack a staging tensor ``[num_layers, 2, n, block_tokens, Hkv, D]`` into blocks ``ids`` (n of them,
    no repeats) of ``pool``, in one launch."""
    rt.require_kernels()
    _check_pair(staging, pool, "scatter_blocks")
    dev = pool.device
    dids = _ids_tensor(ids, pool.shape[2], "destination", dev, unique=True)
    n = int(dids.shape[0])
    if staging.shape[2] != n:
        raise ValueError(f"scatter_blocks: staging holds {staging.shape[2]} blocks, {n} ids given")
    sids = torch.arange(n, dtype=torch.int64, device=dev)
    _launch(rows_view(staging), rows_view(pool), sids, dids, threads, target_ctas)
