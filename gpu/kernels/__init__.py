"""numba.cuda kernels for the GPU hot paths, their torch references, and thin host wrappers over torch
tensors.

- ``paged_attention_decode``: one query token per sequence over its paged K/V; shared-memory tiles, online
  softmax, GQA, FlashDecoding split over ``target_ctas`` CTAs. References: ``paged_attention_decode_ref``
  (exact, float64), ``paged_attention_decode_torch`` (``LlamaModel.decode``'s gather + SDPA),
  ``dense_attention_decode_torch`` (SDPA over contiguous K/V).
- ``copy_blocks`` / ``gather_blocks`` / ``scatter_blocks``: every layer, K and V, of a list of KV blocks in
  one launch (the KV transport's copy; bytewise, any dtype). Reference: ``copy_blocks_ref``.
- ``tiled_linear``: ``y = x @ W.T`` with shared-memory tiles, register micro-tiles and split-K
  (``target_ctas``). Reference: ``linear_ref`` / ``torch.matmul``.
- ``mma_linear`` / ``mma_attention_decode``: the same products on tensor cores (``mma.sync.m16n8k16``, bf16/f16 in,
  fp32 accumulate; CUDA C++ tile in ``mma_tile.cu`` linked into numba kernels, a Python twin under the simulator).

Wrappers take torch tensors: CUDA tensors on a GPU (zero copy through ``__cuda_array_interface__``, launched
on torch's current stream), CPU tensors under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` set before numba
is imported; tiny sizes only). Importing this package does not import numba; the first kernel call does.
``TargetCtasTuner`` (autotune.py) picks ``target_ctas`` per GPU and shape and caches it.
"""
from ._runtime import cuda_device_available, kernels_available, simulator
from .autotune import TargetCtasTuner, default_target_ctas
from .kv_copy import copy_blocks, gather_blocks, scatter_blocks
from .matmul import plan_split_k, tiled_linear
from .mma import mma_linear
from .mma_attention import mma_attention_decode
from .paged_attention import paged_attention_decode, plan_splits
from .reference import (copy_blocks_ref, dense_attention_decode_torch, linear_ref, paged_attention_decode_ref,
                        paged_attention_decode_torch)

__all__ = [
    "TargetCtasTuner", "copy_blocks", "copy_blocks_ref", "cuda_device_available", "default_target_ctas",
    "dense_attention_decode_torch", "gather_blocks", "kernels_available", "linear_ref", "mma_attention_decode",
    "mma_linear",
    "paged_attention_decode", "paged_attention_decode_ref", "paged_attention_decode_torch", "plan_split_k",
    "plan_splits", "scatter_blocks", "simulator", "tiled_linear",
]
