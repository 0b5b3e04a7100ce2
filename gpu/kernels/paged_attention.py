"""Paged-attention decode in numba.cuda: one new query token per sequence, K/V read through the block table.

Algorithm (sources):

* Paging: vLLM's PagedAttention (Kwon et al., SOSP 2023, "Efficient Memory Management for Large Language
  Model Serving with PagedAttention"): token ``p`` of sequence ``b`` is at block ``block_tables[b, p // bt]``,
  offset ``p % bt`` of the pool ``[num_blocks, block_tokens, Hkv, D]`` (one layer's K or V).
* Online softmax over key tiles staged in shared memory: FlashAttention (Dao et al., NeurIPS 2022) after
  Milakov & Gimelshein 2018: keep a running max ``m`` and denominator ``l`` per query head, rescale the
  accumulator by ``exp(m_old - m_new)`` at every tile, divide by ``l`` at the end. No ``[S]`` score vector is
  ever written to global memory.
* Split-sequence: FlashDecoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context
  inference"): with few sequences there are too few (sequence, kv head) CTAs to fill the GPU, so the context
  is cut into ``splits`` chunks, each CTA writes an unnormalised partial ``(acc, m, l)``, and a second kernel
  combines them: ``out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s`` with ``M = max_s m_s``. The
  ``target_ctas`` knob sets how many CTAs the first kernel should spread over.
* GQA (Ainslie et al. 2023): one CTA per (sequence, kv head, split) serves the ``G = H / Hkv`` query heads
  that share the kv head, so each K/V element is read from global memory once per CTA, not G times.

CTA work, per tile of ``TILE`` tokens (``NT`` threads): stage K and V ``[TILE, D]`` in shared memory (K rows
padded to ``D + 1`` floats so the score loop is free of bank conflicts), compute scores ``[G, TILE]``, update
``m``/``l`` (one thread per query head), then every thread updates its ``ceil(G*D / NT)`` accumulator
elements. Math is float32 whatever the storage (fp32, fp16 or bf16).
"""
from __future__ import annotations

import functools
import math

import torch

from . import _runtime as rt
from ._loads import kernel_view, kind_of, load_fn
from .reference import _check_decode_args

STATIC_SHARED_LIMIT = 48 * 1024  # bytes of static shared memory a CTA may declare

# ``numba.cuda``, bound on first use. Kernels must reach it as a module global: the simulator swaps the
# module's globals for its fake ``cuda`` while a kernel runs (closure variables would not be swapped).
cuda = None


def plan_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, tile_tokens: int,
                target_ctas: int | None) -> tuple[int, int]:
    """FlashDecoding split plan: ``(splits, tokens_per_split)``.

    The first kernel runs ``num_seqs * num_kv_heads * splits`` CTAs. ``splits`` starts as the smallest count
    that reaches ``target_ctas`` (1 when ``target_ctas`` is None/0 or already reached without splitting),
    capped at one tile per split; ``tokens_per_split`` is then rounded up to whole tiles, which can leave
    slightly fewer splits, never an empty one for the longest sequence: ``(splits - 1) * tokens_per_split <
    max_seq_len <= splits * tokens_per_split`` (a shorter sequence leaves its last splits empty, which the
    combine step ignores). Raises ValueError for a non-positive size.
    """
    if num_seqs < 1 or num_kv_heads < 1 or max_seq_len < 1 or tile_tokens < 1:
        raise ValueError(f"plan_splits: sizes must be >= 1 (num_seqs={num_seqs}, "
                         f"num_kv_heads={num_kv_heads}, max_seq_len={max_seq_len}, "
                         f"tile_tokens={tile_tokens})")
    base = num_seqs * num_kv_heads
    splits = 1 if not target_ctas or target_ctas <= base else -(-int(target_ctas) // base)
    tiles = -(-max_seq_len // tile_tokens)
    splits = max(1, min(splits, tiles))
    tokens_per_split = -(-tiles // splits) * tile_tokens
    splits = -(-max_seq_len // tokens_per_split)
    return splits, tokens_per_split


def pick_tile_tokens(head_dim: int, group: int, want: int) -> int:
    """Largest tile <= ``want`` whose shared memory (q ``[G, D]``, K ``[T, D+1]``, V ``[T, D]``, p ``[G, T]``,
    3 ``[G]`` vectors, float32) fits the 48 KiB static limit; at least 1."""
    tile = max(1, int(want))
    while tile > 1 and 4 * (group * head_dim + tile * (2 * head_dim + 1) + group * tile + 3 * group) \
            > STATIC_SHARED_LIMIT:
        tile //= 2
    return tile


@functools.lru_cache(maxsize=None)
def _decode_kernel(D: int, G: int, TILE: int, NT: int, BT: int, q_kind: str, kv_kind: str):
    """Compile-time specialised decode kernel: shared array shapes must be constants, and a constant block
    size ``BT`` turns ``pos // BT`` into a multiply-shift instead of a 64-bit division per staged element."""
    global cuda
    cuda = rt._cuda()
    from numba import float32  # noqa: PLC0415

    ld_q = load_fn(q_kind)
    ld_kv = load_fn(kv_kind)
    DP = D + 1  # padded K row: thread j reads k_s[j, d], stride D + 1 words -> distinct banks
    GD = G * D
    PER = (GD + NT - 1) // NT  # accumulator elements per thread

    @cuda.jit
    def decode(q, k_cache, v_cache, block_tables, seq_lens, scale, tokens_per_split, out, part_acc, part_ml):
        # grid (B, Hkv, splits), block NT threads.
        # q: [B, H, D]; k_cache, v_cache: [num_blocks, block_tokens, Hkv, D]; block_tables: [B, max_blocks]
        # seq_lens: [B]; out: [B, H, D] f32 (splits == 1);
        # part_acc: [B, H, splits, D] f32, part_ml: [B, H, splits, 2] f32 (max, denominator; splits > 1)
        b = cuda.blockIdx.x
        kvh = cuda.blockIdx.y
        split = cuda.blockIdx.z
        nsplit = cuda.gridDim.z
        tid = cuda.threadIdx.x
        neg_inf = float32(-math.inf)
        zero = float32(0.0)
        sc = float32(scale)

        q_s = cuda.shared.array((G, D), float32)  # q_s: [G, D] scaled queries of this kv head's group
        k_s = cuda.shared.array((TILE, DP), float32)  # k_s: [TILE, D (+1 pad)]
        v_s = cuda.shared.array((TILE, D), float32)  # v_s: [TILE, D]
        p_s = cuda.shared.array((G, TILE), float32)  # p_s: [G, TILE] scores, then exp(score - m)
        m_s = cuda.shared.array(G, float32)  # running max per query head
        l_s = cuda.shared.array(G, float32)  # running denominator per query head
        a_s = cuda.shared.array(G, float32)  # this tile's rescale factor exp(m_old - m_new)
        acc = cuda.local.array(PER, float32)  # acc[r]: element tid + r * NT of the [G, D] accumulator

        n_ctx = seq_lens[b]
        start = split * tokens_per_split
        end = min(n_ctx, start + tokens_per_split)
        h0 = kvh * G
        for i in range(tid, GD, NT):
            g = i // D
            q_s[g, i - g * D] = ld_q(q[b, h0 + g, i - g * D]) * sc
        if tid < G:
            m_s[tid] = neg_inf
            l_s[tid] = zero
        for r in range(PER):
            acc[r] = zero
        cuda.syncthreads()

        for t0 in range(start, end, TILE):
            n = min(TILE, end - t0)
            # stage K, V tiles: consecutive threads read consecutive d of one token (coalesced)
            for i in range(tid, TILE * D, NT):
                j = i // D
                if j < n:
                    d = i - j * D
                    pos = t0 + j
                    blk = block_tables[b, pos // BT]
                    off = pos - (pos // BT) * BT
                    k_s[j, d] = ld_kv(k_cache[blk, off, kvh, d])
                    v_s[j, d] = ld_kv(v_cache[blk, off, kvh, d])
            cuda.syncthreads()
            # scores [G, TILE]
            for i in range(tid, G * TILE, NT):
                g = i // TILE
                j = i - g * TILE
                s = neg_inf
                if j < n:
                    s = zero
                    for d in range(D):
                        s += q_s[g, d] * k_s[j, d]
                p_s[g, j] = s
            cuda.syncthreads()
            # online softmax statistics, one thread per query head
            if tid < G:
                m_old = m_s[tid]
                m_new = m_old
                for j in range(n):
                    m_new = max(m_new, p_s[tid, j])
                alpha = math.exp(m_old - m_new)  # 0 on the first tile (m_old = -inf)
                tot = zero
                for j in range(TILE):
                    e = zero
                    if j < n:
                        e = math.exp(p_s[tid, j] - m_new)
                    p_s[tid, j] = e
                    tot += e
                l_s[tid] = l_s[tid] * alpha + tot
                m_s[tid] = m_new
                a_s[tid] = alpha
            cuda.syncthreads()
            # acc = acc * alpha + p @ V
            for r in range(PER):
                i = tid + r * NT
                if i < GD:
                    g = i // D
                    d = i - g * D
                    x = acc[r] * a_s[g]
                    for j in range(n):
                        x += p_s[g, j] * v_s[j, d]
                    acc[r] = x
            cuda.syncthreads()

        for r in range(PER):
            i = tid + r * NT
            if i < GD:
                g = i // D
                d = i - g * D
                if nsplit == 1:
                    out[b, h0 + g, d] = acc[r] / l_s[g]
                else:
                    part_acc[b, h0 + g, split, d] = acc[r]
        if nsplit > 1 and tid < G:
            part_ml[b, h0 + tid, split, 0] = m_s[tid]  # -inf for an empty split
            part_ml[b, h0 + tid, split, 1] = l_s[tid]  # 0 for an empty split

    return decode


@functools.lru_cache(maxsize=None)
def _combine_kernel(NT: int):
    """FlashDecoding's second pass: merge the per-split partials of every (sequence, query head)."""
    global cuda
    cuda = rt._cuda()
    from numba import float32  # noqa: PLC0415

    @cuda.jit
    def combine(part_acc, part_ml, out):
        # grid (B, H), block NT threads.
        # part_acc: [B, H, splits, D] f32; part_ml: [B, H, splits, 2] f32; out: [B, H, D] f32
        b = cuda.blockIdx.x
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        S = part_ml.shape[2]
        D = out.shape[2]
        neg_inf = float32(-math.inf)
        m = neg_inf
        for s in range(S):
            m = max(m, part_ml[b, h, s, 0])
        den = float32(0.0)
        for s in range(S):
            ms = part_ml[b, h, s, 0]
            if ms > neg_inf:
                den += math.exp(ms - m) * part_ml[b, h, s, 1]
        for d in range(tid, D, NT):
            num = float32(0.0)
            for s in range(S):
                ms = part_ml[b, h, s, 0]
                if ms > neg_inf:
                    num += math.exp(ms - m) * part_acc[b, h, s, d]
            out[b, h, d] = num / den

    return combine


def default_threads(group: int) -> int:
    """Threads per CTA: 128 on a device (4 warps), 32 in the simulator (each thread is a Python thread);
    always >= the query group size (one thread per head updates the softmax statistics)."""
    want = 32 if rt.simulator() else 128
    return max(want, -(-group // 32) * 32)


def paged_attention_decode(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, *, layer: int | None = None, scale: float | None = None,
                           target_ctas: int | None = None, max_seq_len: int | None = None,
                           tile_tokens: int | None = None, threads: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged K/V (numba kernel).

    Args:
        q: ``[B, H, D]`` float32/float16/bfloat16, the new tokens' queries (RoPE applied).
        kv: ``[2, num_blocks, block_tokens, Hkv, D]`` one layer of the pool (K at 0, V at 1), or the whole
            ``[num_layers, 2, ...]`` pool with ``layer``; float32/float16/bfloat16; ``H % Hkv == 0``.
        block_tables: ``[B, max_blocks]`` integer block ids (int32 preferred; others are converted).
        seq_lens: ``[B]`` keys per sequence, >= 1 (the new token's K/V must already be in the pool).
        layer: which layer of a 6-D pool.
        scale: softmax scale; default ``1 / sqrt(D)``.
        target_ctas: how many CTAs to spread over (FlashDecoding split, see :func:`plan_splits`); None or 0:
            one CTA per (sequence, kv head).
        max_seq_len: ``max(seq_lens)`` if the caller knows it (saves a device -> host read on CUDA).
        tile_tokens: keys per shared-memory tile (default 32 on a device, 8 in the simulator; lowered to fit
            48 KiB of shared memory).
        threads: threads per CTA (default :func:`default_threads`).
        out: optional ``[B, H, D]`` float32 output buffer.
    Returns:
        ``[B, H, D]``: ``out`` if given, else float32 for float32 ``q``, else ``q.dtype``.
    Raises:
        ValueError: mismatched shapes; on CPU (simulator) tensors also a length < 1 or past the block table,
            or a block id outside the pool (on CUDA these are not checked: checking would sync the stream).
        RuntimeError: no CUDA device and no simulator.
    """
    rt.require_kernels()
    if kv.dim() == 6:
        if layer is None:
            raise ValueError("a 6-D KV pool needs layer=")
        kv = kv[layer]
    _check_decode_args(q, kv, block_tables, seq_lens)
    B, H, D = q.shape
    num_blocks, bt, Hkv = kv.shape[1], kv.shape[2], kv.shape[3]
    G = H // Hkv
    if q.device != kv.device or block_tables.device != kv.device or seq_lens.device != kv.device:
        raise ValueError(f"q ({q.device}), kv ({kv.device}), block_tables ({block_tables.device}) and "
                         f"seq_lens ({seq_lens.device}) must be on one device")
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    if not kv.is_cuda:  # cheap host-side checks (a bad id on a device would be an illegal address)
        if int(lens.min()) < 1 or int(lens.max()) > tables.shape[1] * bt:
            raise ValueError(f"seq_lens must be in [1, {tables.shape[1] * bt}] (block table of "
                             f"{tables.shape[1]} blocks of {bt}); got {lens.tolist()}")
        for b in range(B):
            used = tables[b, :(int(lens[b]) - 1) // bt + 1]
            if int(used.min()) < 0 or int(used.max()) >= num_blocks:
                raise ValueError(f"sequence {b}: block ids must be in [0, {num_blocks}); got {used.tolist()}")
    S = int(lens.max()) if max_seq_len is None else int(max_seq_len)
    NT = int(threads) if threads else default_threads(G)
    if NT < G:
        raise ValueError(f"threads={NT} must be >= the query group size {G}")
    TILE = pick_tile_tokens(D, G, tile_tokens or (8 if rt.simulator() else 32))
    splits, tokens_per_split = plan_splits(B, Hkv, S, TILE, target_ctas)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)

    dev = q.device
    result = out if out is not None else torch.empty(B, H, D, dtype=torch.float32, device=dev)
    if result.shape != (B, H, D) or result.dtype != torch.float32 or not result.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 [{B}, {H}, {D}] tensor")
    if splits > 1:
        part_acc = torch.empty(B, H, splits, D, dtype=torch.float32, device=dev)
        part_ml = torch.empty(B, H, splits, 2, dtype=torch.float32, device=dev)
    else:  # unused by the kernel; typed placeholders
        part_acc = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=dev)
        part_ml = torch.empty(1, 1, 1, 2, dtype=torch.float32, device=dev)

    kernel = _decode_kernel(D, G, TILE, NT, bt, kind_of(q), kind_of(kv))
    kvk = kernel_view(kv)
    A = rt.as_kernel_array
    with rt.on_device_of(q):
        stream = rt.launch_stream(q)
        kernel[(B, Hkv, splits), NT, stream](
            A(kernel_view(q)), A(kvk[0]), A(kvk[1]), A(tables), A(lens), scale, tokens_per_split,
            A(result), A(part_acc), A(part_ml))
        if splits > 1:
            nt2 = min(NT, max(32, -(-D // 32) * 32)) if not rt.simulator() else min(NT, D)
            _combine_kernel(nt2)[(B, H), nt2, stream](A(part_acc), A(part_ml), A(result))
    if out is not None or q.dtype == torch.float32:
        return result
    return result.to(q.dtype)
