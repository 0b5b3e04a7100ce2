"""Decode attention on tensor cores: QK^T and PV as ``mma.m16n8k16`` tiles (gpu/kernels/mma.py) over a paged
bf16 KV cache, with the online softmax of FlashAttention-2 kept in the MMA's accumulator fragments.

| name | what |
|---|---|
| :func:`mma_attention_decode` | one query token per sequence; a warp per (sequence, kv head) |
| :func:`attention_kernel_source` | the kernel before ``cuda.jit`` (also what the PTX check links) |

One warp serves a (sequence, kv head): its ``G = H / Hkv`` query heads are the 16 rows of the A tile (rows past
``G`` are zero), so GQA groups up to 16 share each K/V load. For every 16 keys: ``S = Q K^T`` is two 16x8 MMA
tiles per 16 dims of the head (``B[d][n] = K[key n][d]``: a K row is a B column, read as 32-bit pairs); the
scaled scores get a running row max and sum (rows reduced over the four lanes of a quad through shared memory);
``P`` is rounded to bf16 and repacked from the two S accumulators into one A fragment without leaving registers
(the C layout of two adjacent n-tiles is the A layout of one k-tile); ``O += P V`` is one MMA per 8 dims. Scores
and O accumulate in float32. Keys past a sequence's length weigh 0 and are never read. Source: Dao,
"FlashAttention-2" (2023), section 3; the fragment layouts are PTX ISA "mma.m16n8k16".
Not here yet: a split of long contexts over several CTAs (gpu/kernels/paged_attention.py's ``target_ctas``) and
fp16/fp32 storage.
"""
from __future__ import annotations

import functools
import math

import torch

from . import _runtime as rt
from .mma import jit_kernel, mma_fn, pack_fn, scratch_shape

cuda = None  # numba.cuda, bound on first use (a module global: the simulator swaps it)


@functools.lru_cache(maxsize=None)
def bf16_bits_fn():
    """``bits(x) -> uint32``: float32 ``x`` rounded to bfloat16 (nearest even), its 16 bits in the low half."""
    global cuda
    cuda = rt._cuda()
    from numba import uint32  # noqa: PLC0415

    if rt.simulator():
        import numpy as np  # noqa: PLC0415

        def bits_sim(x):
            b = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
            return uint32(((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF)

        return cuda.jit(device=True)(bits_sim)
    from numba.cuda import libdevice  # noqa: PLC0415

    @cuda.jit(device=True, inline=True)
    def bits(x):
        b = uint32(libdevice.float_as_int(x))
        return uint32(((b + uint32(0x7FFF) + ((b >> uint32(16)) & uint32(1))) >> uint32(16)) & uint32(0xFFFF))

    return bits


def attention_kernel_source(D: int, G: int, BT: int):
    """``kernel(q, k, v, tables, lens, scale, out)``: ``q [B, H, D]``, ``k``/``v [blocks, BT, Hkv, D]`` int16
    bf16 bits, ``tables [B, max_blocks]`` int32, ``lens [B]`` int32, ``out [B, H, D]`` float32; grid ``(B, Hkv)``,
    32 threads."""
    global cuda
    cuda = rt._cuda()
    from numba import float32, int32, uint32  # noqa: PLC0415

    if D % 16 or not 1 <= G <= 16:
        raise ValueError(f"mma attention needs head_dim % 16 == 0 and 1 <= H / Hkv <= 16; got {D}, {G}")
    mma, bits, pack = mma_fn("bf16"), bf16_bits_fn(), pack_fn()
    SCR = scratch_shape(1)
    KS, NO = D // 16, D // 8  # k-steps of QK^T over the head dim; 8-dim tiles of O
    NEG = -math.inf

    @cuda.jit(device=True, inline=True)
    def q_pair(q, b, head0, r, d):  # A[r][d..d+1] of the query tile: head head0 + r, zero past the group
        if r >= G:
            return uint32(0)
        return pack(q[b, head0 + r, d], q[b, head0 + r, d + 1])

    @cuda.jit(device=True, inline=True)
    def k_pair(k, tables, b, key, h, d, n):  # K[key][d..d+1]: a column of B for S = Q K^T
        if key >= n:
            return uint32(0)
        blk = tables[b, key // BT]
        return pack(k[blk, key % BT, h, d], k[blk, key % BT, h, d + 1])

    @cuda.jit(device=True, inline=True)
    def v_at(v, tables, b, key, h, d, n):
        if key >= n:
            return int32(0)
        return int32(v[tables[b, key // BT], key % BT, h, d])

    @cuda.jit(device=True, inline=True)
    def quad(red, row, lane, x, is_max):  # x reduced over the four lanes of this lane's quad (max or sum)
        red[row, lane] = x
        cuda.syncthreads()
        base = (lane // 4) * 4
        r = red[row, base]
        for i in range(1, 4):
            r = max(r, red[row, base + i]) if is_max else r + red[row, base + i]
        cuda.syncthreads()
        return r

    def kernel(q, k, v, tables, lens, scale, out):
        b, h = cuda.blockIdx.x, cuda.blockIdx.y
        lane = cuda.threadIdx.x
        g, t = lane // 4, lane % 4
        n = lens[b]
        head0 = h * G
        scratch = cuda.shared.array(SCR, uint32)
        red = cuda.shared.array((2, 32), float32)
        qf = cuda.local.array((KS, 4), uint32)  # Q's A fragments, one per 16 dims
        o = cuda.local.array((NO, 4), float32)  # O's accumulators, one per 8 dims
        sv = cuda.local.array((2, 4), float32)  # this 16-key chunk's scores: two n-tiles of 8 keys
        for s in range(KS):
            d = 16 * s + 2 * t
            qf[s, 0], qf[s, 1] = q_pair(q, b, head0, g, d), q_pair(q, b, head0, g + 8, d)
            qf[s, 2], qf[s, 3] = q_pair(q, b, head0, g, d + 8), q_pair(q, b, head0, g + 8, d + 8)
        for j in range(NO):
            for i in range(4):
                o[j, i] = 0.0
        m_lo, m_hi, l_lo, l_hi = float32(NEG), float32(NEG), float32(0.0), float32(0.0)  # rows g, g + 8
        for kc in range(0, n, 16):
            for j in range(2):
                key = kc + 8 * j + g
                c0, c1, c2, c3 = float32(0.0), float32(0.0), float32(0.0), float32(0.0)
                for s in range(KS):
                    d = 16 * s + 2 * t
                    c0, c1, c2, c3 = mma(scratch, 0, lane, qf[s, 0], qf[s, 1], qf[s, 2], qf[s, 3],
                                         k_pair(k, tables, b, key, h, d, n), k_pair(k, tables, b, key, h, d + 8, n),
                                         c0, c1, c2, c3)
                sv[j, 0], sv[j, 1], sv[j, 2], sv[j, 3] = c0, c1, c2, c3
            mx_lo, mx_hi = float32(NEG), float32(NEG)
            for j in range(2):
                for i in range(4):  # element i of tile j: row g + 8 (i // 2), key kc + 8 j + 2 t + i % 2
                    sv[j, i] = sv[j, i] * scale if kc + 8 * j + 2 * t + i % 2 < n else float32(NEG)
                mx_lo = max(mx_lo, max(sv[j, 0], sv[j, 1]))
                mx_hi = max(mx_hi, max(sv[j, 2], sv[j, 3]))
            new_lo = max(m_lo, quad(red, 0, lane, mx_lo, True))
            new_hi = max(m_hi, quad(red, 1, lane, mx_hi, True))
            corr_lo = math.exp(m_lo - new_lo) if m_lo != NEG else float32(0.0)
            corr_hi = math.exp(m_hi - new_hi) if m_hi != NEG else float32(0.0)
            m_lo, m_hi = new_lo, new_hi
            for j in range(2):
                for i in range(4):
                    sv[j, i] = math.exp(sv[j, i] - (m_lo if i < 2 else m_hi)) if sv[j, i] != NEG else float32(0.0)
            l_lo = l_lo * corr_lo + sv[0, 0] + sv[0, 1] + sv[1, 0] + sv[1, 1]
            l_hi = l_hi * corr_hi + sv[0, 2] + sv[0, 3] + sv[1, 2] + sv[1, 3]
            # P's A fragment: keys 2t, 2t+1 of tile 0 are a0 (row g) / a1 (row g+8); of tile 1, a2 / a3
            p0 = bits(sv[0, 0]) | (bits(sv[0, 1]) << uint32(16))
            p1 = bits(sv[0, 2]) | (bits(sv[0, 3]) << uint32(16))
            p2 = bits(sv[1, 0]) | (bits(sv[1, 1]) << uint32(16))
            p3 = bits(sv[1, 2]) | (bits(sv[1, 3]) << uint32(16))
            key = kc + 2 * t
            for j in range(NO):
                d = 8 * j + g  # B[key][d] = V[key][d]: two keys of one dim per register
                b0 = pack(v_at(v, tables, b, key, h, d, n), v_at(v, tables, b, key + 1, h, d, n))
                b1 = pack(v_at(v, tables, b, key + 8, h, d, n), v_at(v, tables, b, key + 9, h, d, n))
                o[j, 0], o[j, 1], o[j, 2], o[j, 3] = mma(scratch, 0, lane, p0, p1, p2, p3, b0, b1,
                                                         o[j, 0] * corr_lo, o[j, 1] * corr_lo,
                                                         o[j, 2] * corr_hi, o[j, 3] * corr_hi)
        l_lo = quad(red, 0, lane, l_lo, False)
        l_hi = quad(red, 1, lane, l_hi, False)
        for j in range(NO):
            d = 8 * j + 2 * t
            if g < G:
                out[b, head0 + g, d] = o[j, 0] / l_lo
                out[b, head0 + g, d + 1] = o[j, 1] / l_lo
            if g + 8 < G:
                out[b, head0 + g + 8, d] = o[j, 2] / l_hi
                out[b, head0 + g + 8, d + 1] = o[j, 3] / l_hi

    return kernel


@functools.lru_cache(maxsize=None)
def _attention_kernel(D: int, G: int, BT: int):
    return jit_kernel(attention_kernel_source(D, G, BT))


def mma_attention_decode(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         *, layer: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged bf16 K/V, on tensor cores.

    Args:
        q: ``[B, H, D]`` bfloat16 queries (RoPE applied); ``D % 16 == 0``; ``H / Hkv`` at most 16.
        kv: ``[2, num_blocks, block_tokens, Hkv, D]`` bfloat16 (K at 0, V at 1), or the ``[num_layers, 2, ...]``
            pool with ``layer``.
        block_tables: ``[B, max_blocks]`` block ids; seq_lens: ``[B]`` keys per sequence (>= 1).
        scale: softmax scale, default ``1 / sqrt(D)``.
    Returns:
        ``[B, H, D]`` float32.
    Raises:
        TypeError: a dtype other than bfloat16. ValueError: shapes (see :func:`attention_kernel_source`).
    """
    rt.require_kernels()
    if kv.dim() == 6:
        if layer is None:
            raise ValueError("a 6-D KV pool needs layer=")
        kv = kv[layer]
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise TypeError(f"mma_attention_decode takes bfloat16 q and kv; got {q.dtype}, {kv.dtype}")
    B, H, D = q.shape
    if kv.dim() != 5 or kv.shape[0] != 2 or kv.shape[4] != D or H % kv.shape[3]:
        raise ValueError(f"kv must be [2, blocks, block_tokens, Hkv, {D}] with H % Hkv == 0; got {tuple(kv.shape)}")
    bt, Hkv = kv.shape[2], kv.shape[3]
    kernel = _attention_kernel(D, H // Hkv, bt)
    out = torch.empty(B, H, D, dtype=torch.float32, device=q.device)
    A = rt.as_kernel_array
    kvk = kv.view(torch.int16)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    with rt.on_device_of(q):
        kernel[(B, Hkv), 32, rt.launch_stream(q)](
            A(q.contiguous().view(torch.int16)), A(kvk[0]), A(kvk[1]), A(block_tables.to(torch.int32)),
            A(seq_lens.to(torch.int32)), scale, A(out))
    return out
