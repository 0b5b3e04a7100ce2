"""Low-bit GEMV for CPU decode steps: GGUF Q4 / Q8_0 weights times int8-quantized activations, in numba.

The method is llama.cpp's (``ggml_vec_dot_q4_0_q8_0`` / ``ggml_vec_dot_q8_0_q8_0`` in ggml-cpu): each row of
the activations is quantized to int8 per group of 32 (``scale = max |x| / 127``, ggml's ``quantize_row_q8_0``),
the group's dot products run in integers, and one float multiply-add per group applies both scales. Rounding
the activations costs top-1 agreement only at near ties (`python -m bench.quality` measures it).

Weights are laid out in tiles of :data:`TILE_ROWS` output rows so the integer work runs across rows, one
vector lane per row (Q4: per row and pair of inputs), with no horizontal sums (``R`` = ``TILE_ROWS``,
``G = K / 32``)::

    Q4 codes  [N / R, G, 8, 2 R] uint8: byte (t, g, p, 2 r + e) = code 2p + e (low half) | code 16 + 2p + e
              (high half) of row t * R + r in group g (ggml's nibble order); weight = scale * code + min
    Q5 codes  [N / R, G, 10, 2 R] uint8: the Q4 layout of the low four bits, then two rows of fifth-bit planes
              (``q5_tiles``); weight = scale * code + min
    Q8 codes  [N / R, G, 32, R] int8:  weight = scale * code
    scale, min [N / R, G, R] float32

The inner loops are written in LLVM IR, so the partial sums stay in registers (numba's own loops kept them in
memory and ran 3x slower). The Q4 loop multiplies pairs of unsigned codes by pairs of signed activations and adds
each pair (x86's ``pmaddubsw``, as ggml's AVX2 path does: called directly where the host has AVX2, spelled out
in portable IR elsewhere, ~3x slower); the Q8 loop is portable IR that LLVM widens to the host's vectors.

Batch invariance: a row's output never depends on the other rows of the call. The GEMVs and ``_quantized`` say
``fastmath=False`` explicitly: numba's CPU target inherits ``fastmath`` from the caller for a callee that does not
set it (``inherit_if_not_set`` in numba/core/cpu.py), so compiled first under ``decode_layers`` (fastmath) they got
LLVM's fast flags, and the contraction into FMAs differed between the two rows of a pair and the odd row run
alone (the last bit of a row moved with its place in the batch, and with which caller compiled the cached
kernel first). Without fast flags each row's scale multiply-adds run as written, the same in both paths. Only
the model's processes import this module (numba's import and its cached machine code load at actor start, not on
a request's path).
"""
from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from llvmlite import binding as llvm
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from .attention_cpu import _splat, attend_decode_row, from_f32, to_f32

__all__ = ["TILE_ROWS", "q4_tiles", "q8_tiles", "q4_linear", "q8_linear", "q8_rows", "decode_layers",
           "set_threads", "threads"]

TILE_ROWS = 32  # output rows per tile = vector lanes of the inner loop
GROUP = 32      # inputs per scale group (GGUF's Q4_0/Q4_1/Q8_0 block)
Q5_ROWS = 10    # rows of 2R bytes per group of a Q5 tile: the Q4 layout's 8, then the fifth-bit planes

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
HOST_AVX2 = bool(llvm.get_host_cpu_features().get("avx2"))  # numba compiles for the host CPU (its cache too)
_threads = 1   # set_threads: the GEMVs' numba threads in this process


def _launch_numba_threads() -> None:
    """Start numba's threading layer now (OpenMP here: its start sets the process's OpenMP thread count to
    ``NUMBA_NUM_THREADS``, all CPUs), keeping torch's intra-op thread count, which shares that OpenMP setting: an
    actor's float32 prefill then ran on two threads beside the other actor's (twice the CPU, 1.4x llama-server's
    multi-round latency against 0.96x). Left to itself the start comes with the first kernel that has parallel
    loops, after torch's count was set."""
    keep = torch.get_num_threads()
    try:
        numba.get_num_threads()   # starts the layer (public API); a bad NUMBA_THREADING_LAYER fails on first use
    except ValueError:
        pass
    finally:
        torch.set_num_threads(keep)


_launch_numba_threads()


def set_threads(n: int) -> int:
    """Run this process's GEMVs (and ``decode_layers`` when told ``parallel``) on ``n`` of numba's threads,
    clamped to 1..``numba.config.NUMBA_NUM_THREADS``; returns the count in force. 1 (the default) runs them
    serially on the caller's thread, as before any call. The tiles are split, never a row's sums: the bits do not
    change. Call from the one thread that runs the kernels (the actor's loop thread: one caller at a time)."""
    global _threads
    n = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    if n > 1 and n != numba.get_num_threads():
        numba.set_num_threads(n)
    _threads = n
    return n


def threads() -> int:
    """The count ``set_threads`` put in force (1: serial)."""
    return _threads


def _ptr(builder, addr, offset_bytes, pointee):
    return builder.inttoptr(builder.add(addr, ir.Constant(addr.type, offset_bytes)), pointee.as_pointer())


def _apply_scales(builder, int_sums, scale_addr, fx, acc_addr):
    """acc[r] += scale[r] * fx * int_sums[r] (vectors of R lanes); returns the updated float vector."""
    vf = ir.VectorType(_F32, TILE_ROWS)
    acc_p = builder.inttoptr(acc_addr, vf.as_pointer())
    scale = builder.load(builder.inttoptr(scale_addr, vf.as_pointer()), align=4)
    term = builder.fmul(builder.fmul(scale, _splat(builder, fx, vf)), builder.sitofp(int_sums, vf))
    return acc_p, builder.fadd(builder.load(acc_p, align=4), term)


def _pair_madd(builder, codes, x_pairs, x86: bool):
    """``<32 x i8>`` unsigned codes and signed activations -> ``<16 x i16>``: ``c[2i] x[2i] + c[2i+1] x[2i+1]``
    (at most 2 * 15 * 127: x86's saturation never applies). ``x86``: ``llvm.x86.avx2.pmadd.ub.sw``."""
    v8, half = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16)
    if x86:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(half, [v8, v8]),
                                            "llvm.x86.avx2.pmadd.ub.sw")
        return builder.call(fn, [codes, x_pairs])
    wide = ir.VectorType(_I16, 32)
    prod = builder.mul(builder.zext(codes, wide), builder.sext(x_pairs, wide))
    undef = ir.Constant(wide, ir.Undefined)
    even, odd = (builder.shuffle_vector(prod, undef, ir.Constant(ir.VectorType(_I32, 16), list(range(e, 32, 2))))
                 for e in (0, 1))
    return builder.add(even, odd)


def _q4_rows_codegen(builder, codes_addr, scale_addr, min_addr, rows, x86: bool = HOST_AVX2, fifth: bool = False):
    """IR for :func:`_q4_group` / :func:`_q4_group2` (and with ``fifth`` :func:`_q5_group` / :func:`_q5_group2`):
    ``rows`` = [(x_addr, fx, sx, acc_addr)] share one unpack of the group's codes. Per row, four int16 partial
    sums (low / high nibbles of tile rows 0-15 / 16-31), each at most 8 * 2 * 15 * 127 = 30480; with ``fifth``
    (codes up to 31) two sets, pairs 0-3 and 4-7 (each at most 4 * 2 * 31 * 127 = 31496), widened before they
    are added."""
    v8, half, half32 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 16)
    low_mask, shift = ir.Constant(v8, [15] * 32), ir.Constant(v8, [4] * 32)
    sets = 2 if fifth else 1
    sums = [[[ir.Constant(half, [0] * 16)] * 4 for _ in range(sets)] for _ in rows]
    if fifth:   # the four bit planes (Q5 layout): byte L of plane k holds bit p = the fifth bit of part k's lane L
        planes = [builder.load(_ptr(builder, codes_addr, 8 * 2 * TILE_ROWS + 32 * k, v8), align=1) for k in range(4)]
        bit4 = ir.Constant(v8, [16] * 32)
    for p in range(8):   # pairs of inputs 2p, 2p + 1 (low nibbles) and 16 + 2p, 17 + 2p (high nibbles)
        c = [builder.load(_ptr(builder, codes_addr, p * 2 * TILE_ROWS + 32 * i, v8), align=1) for i in (0, 1)]
        parts = [builder.and_(c[0], low_mask), builder.and_(c[1], low_mask), builder.lshr(c[0], shift),
                 builder.lshr(c[1], shift)]
        if fifth:   # bit p of the plane moved to bit 4
            move = (lambda v: builder.shl(v, ir.Constant(v8, [4 - p] * 32))) if p <= 4 else (
                lambda v: builder.lshr(v, ir.Constant(v8, [p - 4] * 32)))
            parts = [builder.or_(part, builder.and_(move(plane), bit4)) for part, plane in zip(parts, planes)]
        for r, (x_addr, _, _, _) in enumerate(rows):
            pairs = [_splat(builder, builder.load(_ptr(builder, x_addr, off, _I16), align=1), half)
                     for off in (2 * p, 16 + 2 * p)]   # the two activation bytes, repeated across the lanes
            x_lo, x_hi = (builder.bitcast(v, v8) for v in pairs)
            acc = sums[r][p // 4 if fifth else 0]
            for k, x_pairs in enumerate((x_lo, x_lo, x_hi, x_hi)):
                acc[k] = builder.add(acc[k], _pair_madd(builder, parts[k], x_pairs, x86))
    vf = ir.VectorType(_F32, TILE_ROWS)
    mins = builder.load(builder.inttoptr(min_addr, vf.as_pointer()), align=4)
    concat = ir.Constant(ir.VectorType(_I32, TILE_ROWS), list(range(TILE_ROWS)))
    for (_, fx, sx, acc_addr), per_set in zip(rows, sums):
        wide = [[builder.sext(v, half32) for v in s] for s in per_set]
        lo_a, lo_b, hi_a, hi_b = wide[0] if sets == 1 else [builder.add(a, b) for a, b in zip(*wide)]
        rows_a = builder.add(lo_a, hi_a)   # tile rows 0-15
        rows_b = builder.add(lo_b, hi_b)   # tile rows 16-31
        acc_p, acc = _apply_scales(builder, builder.shuffle_vector(rows_a, rows_b, concat), scale_addr, fx, acc_addr)
        builder.store(builder.fadd(acc, builder.fmul(mins, _splat(builder, sx, vf))), acc_p, align=4)


def _group_kernels(rows_codegen, **options):
    """The numba intrinsics ``(one row, two rows)`` of one tile form, over ``rows_codegen(builder, codes_addr,
    scale_addr, min_addr, rows, **options)``. One row: ``(codes_addr, x_addr, scale_addr, min_addr, fx, sx,
    acc_addr)`` adds one group (32 inputs) of one tile into ``acc`` [R] float32: ``x`` 32 int8 activations, ``fx``
    their scale, ``sx = fx * sum_j x[j]``; two rows: ``(codes_addr, x_addr, x1_addr, scale_addr, min_addr, fx, sx,
    fx1, sx1, acc_addr, acc1_addr)``, both over one unpack of the codes."""
    @intrinsic
    def one(typingctx, codes_addr, x_addr, scale_addr, min_addr, fx, sx, acc_addr):
        sig = types.void(types.intp, types.intp, types.intp, types.intp, types.float32, types.float32, types.intp)

        def codegen(context, builder, signature, args):
            ca, xa, sa, ma, fx, sx, aa = args
            rows_codegen(builder, ca, sa, ma, [(xa, fx, sx, aa)], **options)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def two(typingctx, codes_addr, x_addr, x1_addr, scale_addr, min_addr, fx, sx, fx1, sx1, acc_addr, acc1_addr):
        sig = types.void(types.intp, types.intp, types.intp, types.intp, types.intp, types.float32, types.float32,
                         types.float32, types.float32, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            ca, xa, xa1, sa, ma, fx, sx, fx1, sx1, aa, aa1 = args
            rows_codegen(builder, ca, sa, ma, [(xa, fx, sx, aa), (xa1, fx1, sx1, aa1)], **options)
            return context.get_dummy_value()

        return sig, codegen

    return one, two


# acc[r] += scale[r] * fx * sum_j code[j, r] * x[j] + min[r] * sx; codes: 8 x 2R bytes (two codes each, module
# docstring); with the fifth bits (Q5): 8 x 2R bytes of low four bits, then 4 x 32 bytes of planes (q5_tiles)
_q4_group, _q4_group2 = _group_kernels(_q4_rows_codegen)
_q5_group, _q5_group2 = _group_kernels(_q4_rows_codegen, fifth=True)


@intrinsic
def _q8_group(typingctx, codes_addr, x_addr, scale_addr, fx, acc_addr):
    """acc[r] += scale[r] * fx * sum_j code[j, r] * x[j] over one group of one tile (codes: 32 x R int8).
    Two products fit int16 (2 * 127 * 127 = 32258); pairs are widened to int32 before they are summed."""
    sig = types.void(types.intp, types.intp, types.intp, types.float32, types.intp)

    def codegen(context, builder, signature, args):
        ca, xa, sa, fx, aa = args
        v8, v16, v32 = (ir.VectorType(t, TILE_ROWS) for t in (_I8, _I16, _I32))
        sums = ir.Constant(v32, [0] * TILE_ROWS)
        xp = builder.inttoptr(xa, _I8.as_pointer())
        for j in range(0, GROUP, 2):
            pair = ir.Constant(v16, [0] * TILE_ROWS)
            for jj in (j, j + 1):
                c = builder.sext(builder.load(_ptr(builder, ca, jj * TILE_ROWS, v8), align=1), v16)
                x = builder.sext(builder.load(builder.gep(xp, [ir.Constant(_I32, jj)])), _I16)
                pair = builder.add(pair, builder.mul(c, _splat(builder, x, v16)))
            sums = builder.add(sums, builder.sext(pair, v32))
        acc_p, acc = _apply_scales(builder, sums, sa, fx, aa)
        builder.store(acc, acc_p, align=4)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(nogil=True, cache=True, fastmath=True)
def _quantize_rows(x, xq, fx, sx):
    """x float32 [M, K] -> xq int8 [M, K], fx [M, G] (scale per group), sx [M, G] (= fx * sum of the codes)."""
    for b in range(x.shape[0]):
        for g in range(x.shape[1] // GROUP):
            amax = np.float32(0.0)
            for j in range(GROUP):
                amax = max(amax, abs(x[b, g * GROUP + j]))
            scale = amax / np.float32(127.0)
            inv = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
            total = 0
            for j in range(GROUP):
                q = np.int32(np.rint(x[b, g * GROUP + j] * inv))
                xq[b, g * GROUP + j] = q
                total += q
            fx[b, g] = scale
            sx[b, g] = scale * total


@numba.njit(nogil=True, cache=True, fastmath=False)  # explicit: see the module docstring
def _quantized(x):
    """x float32 [M, K] as (int8 codes [M, K], scales [M, K / 32], scale * sum of codes [M, K / 32])."""
    M, K = x.shape
    xq = np.empty((M, K), np.int8)
    fx = np.empty((M, K // GROUP), np.float32)
    sx = np.empty((M, K // GROUP), np.float32)
    _quantize_rows(x, xq, fx, sx)
    return xq, fx, sx


@numba.njit(nogil=True, cache=True, fastmath=False)  # explicit: see the module docstring
def _q8_tile(xq, fx, codes, scale, y, t, acc):
    """Tile ``t`` of ``_q8_gemv``; ``acc``: float32 [R] scratch."""
    M, G = xq.shape[0], codes.shape[1]
    for b in range(M):
        acc[:] = 0.0
        for g in range(G):
            _q8_group(codes[t, g].ctypes.data, xq[b, g * GROUP:].ctypes.data, scale[t, g].ctypes.data,
                      fx[b, g], acc.ctypes.data)
        y[b, t * TILE_ROWS:(t + 1) * TILE_ROWS] = acc


@numba.njit(nogil=True, cache=True, fastmath=False)  # explicit: see the module docstring
def _q8_gemv(x, codes, scale, y):
    """y float32 [M, T * R] = x float32 [M, K] times the Q8 tiles."""
    xq, fx, _ = _quantized(x)
    acc = np.empty(TILE_ROWS, np.float32)
    for t in range(codes.shape[0]):
        _q8_tile(xq, fx, codes, scale, y, t, acc)


@numba.njit(nogil=True, cache=True, fastmath=False, parallel=True)  # explicit: see the module docstring
def _q8_gemv_par(x, codes, scale, y):
    """``_q8_gemv`` with its tiles spread over numba's threads: the same bits."""
    xq, fx, _ = _quantized(x)
    T = codes.shape[0]
    acc = np.empty((T, TILE_ROWS), np.float32)
    for t in numba.prange(T):
        _q8_tile(xq, fx, codes, scale, y, t, acc[t])


@numba.njit(nogil=True, cache=True, fastmath=True)
def _rms_norm(x, weight, eps, out):
    """out[b] = x[b] / sqrt(mean(x[b] ** 2) + eps) * weight (HF's LlamaRMSNorm, float32)."""
    for b in range(x.shape[0]):
        total = np.float32(0.0)
        for i in range(x.shape[1]):
            total += x[b, i] * x[b, i]
        inv = np.float32(1.0) / np.sqrt(total / x.shape[1] + eps)
        for i in range(x.shape[1]):
            out[b, i] = x[b, i] * inv * weight[i]


@numba.njit(nogil=True, cache=True, fastmath=True)
def _rope_row(v, cos, sin):
    """In place on one head's ``v`` [D]: ``v * cos + roll(v, D / 2) * sin`` (``sin`` carries rotate_half's sign,
    see ``LlamaModel._ensure_rope``)."""
    half = v.shape[0] // 2
    for i in range(half):
        a, b = v[i], v[i + half]
        v[i] = a * cos[i] + b * sin[i]
        v[i + half] = b * cos[i + half] + a * sin[i + half]


@numba.njit(nogil=True, cache=True, fastmath=True)
def _attend(q, pool_k, pool_v, table, block_tokens, first, length, attn_scale, scores, out):
    """out [H, D] = softmax(q K^T * attn_scale) V over keys ``first .. length - 1`` of one sequence; q [H, D];
    pool_k, pool_v [slots, Hkv, D] (float32, or float16 bits as uint16); table: the sequence's block ids; heads
    share K/V in groups of H / Hkv.
    The sums run in an order fixed by ``first`` and ``length`` alone: a row's result depends on its own query
    and keys only (a decode step's row whose head dim ``attention_cpu.attend_decode_row`` does not take)."""
    group = q.shape[0] // pool_k.shape[1]
    slots = np.empty(length, np.int64)   # the keys' pool slots, once for all heads (no division per key)
    block, offset = first // block_tokens, first % block_tokens
    for s in range(first, length):
        slots[s] = table[block] * block_tokens + offset
        offset += 1
        if offset == block_tokens:
            block, offset = block + 1, 0
    for h in range(q.shape[0]):
        kvh = h // group
        top = np.float32(-np.inf)
        for s in range(first, length):
            slot = slots[s]
            dot = np.float32(0.0)
            for i in range(q.shape[1]):
                dot += q[h, i] * to_f32(pool_k[slot, kvh, i])
            scores[s] = dot * attn_scale
            top = max(top, scores[s])
        total = np.float32(0.0)
        for s in range(first, length):
            scores[s] = np.exp(scores[s] - top)
            total += scores[s]
        for i in range(q.shape[1]):
            out[h, i] = 0.0
        for s in range(first, length):
            slot = slots[s]
            p = scores[s] / total
            for i in range(q.shape[1]):
                out[h, i] += p * to_f32(pool_v[slot, kvh, i])


@numba.njit(nogil=True, cache=True, fastmath=True)
def _row_attention(b, y_qkv, pool, tables, positions, cos, sin, n_heads, block_tokens, attn_scale, attn):
    """Row ``b`` of a decode step, one layer: its Q/K/V (``y_qkv[b]``) roped, its K/V written into ``pool``
    ([2, slots, Hkv, D]) at its position, its attention over positions 0..its own into ``attn[b]``."""
    Hkv, D = pool.shape[2], pool.shape[3]
    n_rope = n_heads + Hkv
    p = positions[b]
    heads = np.empty((n_heads + 2 * Hkv, D), np.float32)
    head_out = np.empty((n_heads, D), np.float32)
    for hh in range(n_heads + 2 * Hkv):
        for i in range(D):
            heads[hh, i] = y_qkv[b, hh * D + i]
    for hh in range(n_rope):
        _rope_row(heads[hh], cos[p], sin[p])
    slot = tables[b, p // block_tokens] * block_tokens + p % block_tokens
    for hh in range(Hkv):   # rounded to the pool's type (float16: nearest even, as the prefill's torch writes)
        for i in range(D):
            pool[0, slot, hh, i] = from_f32(heads[n_heads + hh, i], pool[0, slot, hh, i])
            pool[1, slot, hh, i] = from_f32(heads[n_rope + hh, i], pool[1, slot, hh, i])
    if D % 16 == 0:   # attention_cpu.supported
        attend_decode_row(heads[:n_heads], pool[0], pool[1], tables[b], block_tokens, 0, p + 1, attn_scale, head_out)
    else:
        _attend(heads[:n_heads], pool[0], pool[1], tables[b], block_tokens, 0, p + 1, attn_scale,
                np.empty(p + 1, np.float32), head_out)
    for hh in range(n_heads):
        for i in range(D):
            attn[b, hh * D + i] = head_out[hh, i]


@numba.njit(nogil=True, cache=True, fastmath=True, parallel=True)
def _attention_rows_par(y_qkv, pool, tables, positions, cos, sin, n_heads, block_tokens, attn_scale, attn):
    for b in numba.prange(y_qkv.shape[0]):
        _row_attention(b, y_qkv, pool, tables, positions, cos, sin, n_heads, block_tokens, attn_scale, attn)


@numba.njit(nogil=True, cache=True, fastmath=True)
def _attention_rows(y_qkv, pool, tables, positions, cos, sin, n_heads, block_tokens, attn_scale, attn, parallel):
    """Every row's ``_row_attention`` for one layer of a decode step, the rows over numba's threads when
    ``parallel`` (each row's sums as alone: the same bits)."""
    if parallel and y_qkv.shape[0] > 1:
        _attention_rows_par(y_qkv, pool, tables, positions, cos, sin, n_heads, block_tokens, attn_scale, attn)
    else:
        for b in range(y_qkv.shape[0]):
            _row_attention(b, y_qkv, pool, tables, positions, cos, sin, n_heads, block_tokens, attn_scale, attn)


@numba.njit(nogil=True, cache=True, fastmath=True)
def decode_layers(x, ln_attn, ln_mlp, qkv, o, gate_up, down, pool, block_tokens, tables, positions, cos, sin,
                  n_heads, inter, eps, attn_scale, parallel):
    """Every decoder layer of one decode step (the HF Llama layer, as ``LlamaModel.decode`` computes it) with
    low-bit tiled linears, in one call; ``x`` (the residual stream) is updated in place.

    x: float32 [B, hidden] (the new tokens' embeddings in, the last layer's output out); ln_attn, ln_mlp:
    [L, hidden]; qkv, o, gate_up, down: (tiles, scales, mins) of every layer, a tuple of L arrays each
    (:func:`kernel_view`; fused Q/K/V rows, then gate rows 0..inter-1 and up rows), each layer in its own form (a
    K-quant file's mix: Q4_K on the Q4 tiles, Q5_K/Q5_0/Q5_1 on Q5, Q6_K and fused parts with a Q8_0 on Q8h); pool: [L, 2, slots,
    Hkv, D], float32 or float16 bits (uint16; ``kv_cache_dtype``) (slot = block * block_tokens + offset); tables: int64 [B, blocks] (padded); positions: int64
    [B] (the new token's = keys already cached); cos, sin: float32 [positions, D] (``LlamaModel._ensure_rope``'s
    tables); parallel: the GEMVs' tiles and the rows' attention over numba's threads (``set_threads``; the same
    bits). Each row's new K/V are written at its position before it attends over positions 0..its own. Nothing is
    checked here.
    """
    B, hidden = x.shape
    D = pool.shape[4]
    h = np.empty((B, hidden), np.float32)
    y_qkv = np.empty((B, qkv[0][0].shape[0] * TILE_ROWS), np.float32)
    y_hidden = np.empty((B, o[0][0].shape[0] * TILE_ROWS), np.float32)
    y_gu = np.empty((B, gate_up[0][0].shape[0] * TILE_ROWS), np.float32)
    act = np.empty((B, inter), np.float32)
    attn = np.empty((B, n_heads * D), np.float32)
    for li in range(ln_attn.shape[0]):
        _rms_norm(x, ln_attn[li], eps, h)
        _gemv_threads(h, qkv[0][li], qkv[1][li], qkv[2][li], y_qkv, parallel)
        _attention_rows(y_qkv, pool[li], tables, positions, cos, sin, n_heads, block_tokens, attn_scale, attn,
                        parallel)
        _gemv_threads(attn, o[0][li], o[1][li], o[2][li], y_hidden, parallel)
        x += y_hidden[:, :hidden]
        _rms_norm(x, ln_mlp[li], eps, h)
        _gemv_threads(h, gate_up[0][li], gate_up[1][li], gate_up[2][li], y_gu, parallel)
        for b in range(B):
            for i in range(inter):
                g = y_gu[b, i]
                act[b, i] = g / (np.float32(1.0) + np.exp(-g)) * y_gu[b, inter + i]
        _gemv_threads(act, down[0][li], down[1][li], down[2][li], y_hidden, parallel)
        x += y_hidden[:, :hidden]


def _tile(a: np.ndarray, pad_value=0) -> np.ndarray:
    """[N, G, ...] -> [ceil(N / R), G, ..., R]: rows padded to a whole tile, rows moved to the last axis."""
    n = a.shape[0]
    pad = -n % TILE_ROWS
    if pad:
        a = np.concatenate([a, np.full((pad,) + a.shape[1:], pad_value, a.dtype)])
    tiled = a.reshape((a.shape[0] // TILE_ROWS, TILE_ROWS) + a.shape[1:])
    return np.ascontiguousarray(np.moveaxis(tiled, 1, -1))


def q4_tiles(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tiles for :func:`q4_linear` from ``gpu.quant.Int4Groups`` fields: codes uint8 ``[N, K]`` in 0..15,
    scale and zero float32 ``[N, K / 32]`` with ``w = (code - 8) * scale + zero`` (so ``min = zero - 8 scale``).

    Returns ``{"tiles": uint8 [T, G, 8, 2 R], "tile_scale", "tile_min": float32 [T, G, R]}``,
    ``T = ceil(N / R)``.
    Raises ValueError if ``K`` is not a multiple of 32."""
    n, k = codes.shape
    if k % GROUP:
        raise ValueError(f"Q4 tiles need K % {GROUP} == 0, got K = {k}")
    c = codes.numpy().reshape(n, k // GROUP, GROUP)
    packed = (c[..., :16] | (c[..., 16:] << 4)).astype(np.uint8).reshape(n, k // GROUP, 8, 2)  # [N, G, p, e]
    tiles = _tile(packed)   # [T, G, 8, 2, R]
    tiles = np.ascontiguousarray(tiles.transpose(0, 1, 2, 4, 3)).reshape(tiles.shape[:3] + (2 * TILE_ROWS,))
    s = scale.float().numpy()
    return {"tiles": torch.from_numpy(tiles), "tile_scale": torch.from_numpy(_tile(s)),
            "tile_min": torch.from_numpy(_tile(zero.float().numpy() - 8.0 * s))}


def _nibble_lanes(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes [N, G, 32] -> the Q4 layout's two halves, [T, G, 8, 2 R] each: ``low`` (p, 2 r + e) = code 2p + e
    of row r, ``high`` (p, 2 r + e) = code 16 + 2p + e (rows padded to a whole tile with code 0)."""
    n, g = c.shape[:2]
    out = []
    for half in (c[..., :16], c[..., 16:]):
        t = _tile(np.ascontiguousarray(half).reshape(n, g, 8, 2))   # [T, G, 8, 2, R]
        out.append(np.ascontiguousarray(t.transpose(0, 1, 2, 4, 3)).reshape(t.shape[:3] + (2 * TILE_ROWS,)))
    return out[0], out[1]


def q5_tiles(codes: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tiles for :func:`q5_linear` from ``gpu.quant.Int5Groups`` fields: codes uint8 ``[N, K]`` in 0..31, scale
    and min float32 ``[N, K / 32]`` with ``w = code * scale + min`` (GGUF's Q5_0, Q5_1 and Q5_K exactly).

    Returns ``{"tiles": uint8 [T, G, 10, 2 R], "tile_scale", "tile_min": float32 [T, G, R]}``: rows 0-7 of a
    group are the Q4 layout of the codes' low four bits; rows 8-9 are four bit planes of 32 bytes, part k = (low
    nibbles of tile rows 0-15, of rows 16-31, high nibbles of rows 0-15, of rows 16-31): byte L of plane k holds,
    in bit p, the fifth bit of the code that lane L of part k carries in row p. 28 bytes per 32 weights of a row
    (the file's Q5_0: 22; the Q8h tiles: 44).
    Raises ValueError if ``K`` is not a multiple of 32."""
    n, k = codes.shape
    if k % GROUP:
        raise ValueError(f"Q5 tiles need K % {GROUP} == 0, got K = {k}")
    low, high = _nibble_lanes(codes.numpy().astype(np.uint8).reshape(n, k // GROUP, GROUP))   # [T, G, 8, 64] each
    weights = (1 << np.arange(8, dtype=np.uint8)).reshape(1, 1, 8, 1)
    planes = [((half >> 4) & 1) * weights for half in (low, high)]   # bit p of pair row p
    tiles = np.concatenate([(low & 15) | ((high & 15) << 4)] + [pl.sum(axis=2, dtype=np.uint8)[:, :, None]
                                                                 for pl in planes], axis=2)
    return {"tiles": torch.from_numpy(np.ascontiguousarray(tiles)), "tile_scale": torch.from_numpy(_tile(
        scale.float().numpy())), "tile_min": torch.from_numpy(_tile(mins.float().numpy()))}


def q8_tiles(codes: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tiles for :func:`q8_linear` from ``gpu.quant.Int8Groups`` fields: codes int8 ``[N, K]``, scale float32
    ``[N, K / 32]``. Returns ``{"tiles": int8 [T, G, 32, R], "tile_scale": float32 [T, G, R]}``.
    Raises ValueError if ``K`` is not a multiple of 32."""
    n, k = codes.shape
    if k % GROUP:
        raise ValueError(f"Q8 tiles need K % {GROUP} == 0, got K = {k}")
    return {"tiles": torch.from_numpy(_tile(codes.numpy().reshape(n, k // GROUP, GROUP))),
            "tile_scale": torch.from_numpy(_tile(scale.float().numpy()))}


def _run(kernel, x: torch.Tensor, n: int, *tiles: torch.Tensor) -> torch.Tensor:
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], tiles[0].shape[0] * TILE_ROWS)
    kernel(x.numpy(), *(t.numpy() for t in tiles), y.numpy())
    return y if y.shape[1] == n else y[:, :n]


def q4_linear(x: torch.Tensor, n: int, tiles: torch.Tensor, tile_scale: torch.Tensor,
              tile_min: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for float ``x`` ``[M, K]`` and the Q4 weight ``[n, K]`` in :func:`q4_tiles` form: float32
    ``[M, n]``, on ``threads()`` threads. No shape checks (the caller built the tiles for this ``K``)."""
    return _run(_gemv_par if _threads > 1 else _gemv, x, n, tiles, tile_scale, tile_min)


def q5_linear(x: torch.Tensor, n: int, tiles: torch.Tensor, tile_scale: torch.Tensor,
              tile_min: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for float ``x`` ``[M, K]`` and the weight ``[n, K]`` in :func:`q5_tiles` form: float32
    ``[M, n]``, on ``threads()`` threads."""
    return _run(_gemv_par if _threads > 1 else _gemv, x, n, tiles, tile_scale, tile_min)


def q8_linear(x: torch.Tensor, n: int, tiles: torch.Tensor, tile_scale: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for float ``x`` ``[M, K]`` and the Q8_0 weight ``[n, K]`` in :func:`q8_tiles` form: float32
    ``[M, n]``, on ``threads()`` threads."""
    return _run(_q8_gemv_par if _threads > 1 else _q8_gemv, x, n, tiles, tile_scale)


def q8_rows(ids: torch.Tensor, tiles: torch.Tensor, tile_scale: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` ``[T]`` of a Q8 tiled weight, dequantized: float32 ``[T, K]`` (an embedding lookup)."""
    t, r = ids // TILE_ROWS, ids % TILE_ROWS
    codes = tiles[t, :, :, r].float()  # [T, G, 32]
    return (codes * tile_scale[t, :, r][..., None]).reshape(len(ids), -1)


# --- K-quant sub-groups (GGUF Q5_K, Q6_K, Q5_0, Q5_1; Q4_K runs on the Q4 tiles above) ---------------------------
#
#     Q8h codes  [N / R, G, 8, 4 R] int8: byte (t, g, q, 4 r + e) = code of input 4q + e of row t * R + r;
#                weight = scale[half] * code + min, half = input // 16 in the group
#     scale      [N / R, G, 2, R] float32  (Q6_K's scale per 16 inputs; the other types repeat one per 32)
#     min        [N / R, G, R] float32

HALF = GROUP // 2  # inputs per Q8h scale (Q6_K's sub-block)
QUAD = 4           # inputs per Q8h lane group (one int32 sum per row and quad)


def _quad_madd(builder, codes, x_quad, x86: bool):
    """``<32 x i8>`` signed codes (8 rows x 4 inputs) and the 4 activations repeated -> ``<8 x i32>``: each row's
    sum of 4 products. As ggml's AVX2 int8 dots: ``|code|`` times ``x`` with the code's sign (``pmaddubsw``, at most
    2 * 128 * 127: no saturation), then adjacent pairs summed (``pmaddwd`` by ones); portable IR elsewhere."""
    v8, half, v32 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
    zero = ir.Constant(v8, [0] * 32)
    neg = builder.icmp_signed("<", codes, zero)
    mag = builder.select(neg, builder.sub(zero, codes), codes)
    signed_x = builder.select(neg, builder.sub(zero, x_quad), x_quad)
    pairs = _pair_madd(builder, mag, signed_x, x86)   # <16 x i16>: lane 2i + f = row i, inputs 2f, 2f + 1
    if x86:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32, [half, half]),
                                            "llvm.x86.avx2.pmadd.wd")
        return builder.call(fn, [pairs, ir.Constant(half, [1] * 16)])
    wide = builder.sext(pairs, ir.VectorType(_I32, 16))
    undef = ir.Constant(ir.VectorType(_I32, 16), ir.Undefined)
    even, odd = (builder.shuffle_vector(wide, undef, ir.Constant(ir.VectorType(_I32, 8), list(range(e, 16, 2))))
                 for e in (0, 1))
    return builder.add(even, odd)


def _q8h_rows_codegen(builder, codes_addr, scale_addr, min_addr, rows, x86: bool = HOST_AVX2):
    """IR for :func:`_q8h_group` / :func:`_q8h_group2`: ``rows`` = [(x_addr, fx, sx, acc_addr)] share the loads of
    the group's codes. Per row, half and 8-row block an int32 sum (at most 16 * 128 * 127)."""
    v8, v32, vf = ir.VectorType(_I8, 32), ir.VectorType(_I32, 8), ir.VectorType(_F32, TILE_ROWS)
    sums = [[[ir.Constant(v32, [0] * 8)] * 4 for _ in (0, 1)] for _ in rows]
    for q in range(GROUP // QUAD):
        h = q * QUAD // HALF
        xs = [builder.bitcast(_splat(builder, builder.load(_ptr(builder, x_addr, q * QUAD, _I32), align=1), v32), v8)
              for x_addr, _, _, _ in rows]
        for k in range(TILE_ROWS // 8):
            c = builder.load(_ptr(builder, codes_addr, q * QUAD * TILE_ROWS + 32 * k, v8), align=1)
            for r, x_quad in enumerate(xs):
                sums[r][h][k] = builder.add(sums[r][h][k], _quad_madd(builder, c, x_quad, x86))
    cat16 = ir.Constant(ir.VectorType(_I32, 16), list(range(16)))
    cat32 = ir.Constant(ir.VectorType(_I32, 32), list(range(32)))
    mins = builder.load(builder.inttoptr(min_addr, vf.as_pointer()), align=4)
    for (_, fx, sx, acc_addr), per_half in zip(rows, sums):
        dot = None
        for h, blocks in enumerate(per_half):
            lo = builder.shuffle_vector(blocks[0], blocks[1], cat16)
            hi = builder.shuffle_vector(blocks[2], blocks[3], cat16)
            total = builder.sitofp(builder.shuffle_vector(lo, hi, cat32), vf)
            term = builder.fmul(builder.load(_ptr(builder, scale_addr, h * 4 * TILE_ROWS, vf), align=4), total)
            dot = term if dot is None else builder.fadd(dot, term)
        acc_p = builder.inttoptr(acc_addr, vf.as_pointer())
        acc = builder.fadd(builder.load(acc_p, align=4), builder.fmul(dot, _splat(builder, fx, vf)))
        builder.store(builder.fadd(acc, builder.fmul(mins, _splat(builder, sx, vf))), acc_p, align=4)


# acc[r] += fx * (scale[0, r] * sum_{j<16} code[j, r] x[j] + scale[1, r] * sum_{j>=16} code[j, r] x[j]) + min[r] * sx
# over one group of one Q8h tile (codes: 8 x 4R bytes, layout above)
_q8h_group, _q8h_group2 = _group_kernels(_q8h_rows_codegen)


def _quads(codes: np.ndarray) -> np.ndarray:
    """Tiled codes [T, G, 32, R] -> the Q8h layout [T, G, 8, 4 R] (byte 4 r + e of quad q = input 4 q + e)."""
    T, G = codes.shape[:2]
    return np.ascontiguousarray(codes.reshape(T, G, GROUP // QUAD, QUAD, TILE_ROWS).transpose(0, 1, 2, 4, 3)
                                ).reshape(T, G, GROUP // QUAD, QUAD * TILE_ROWS)


def q8h_tiles(codes: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tiles for :func:`q8h_linear` from ``gpu.quant.Int8HalfGroups`` fields: codes int8 ``[N, K]``, scale
    float32 ``[N, K / 16]``, min float32 ``[N, K / 32]`` (``w = code * scale[k // 16] + min[k // 32]``).

    Returns ``{"tiles": int8 [T, G, 8, 4 R], "tile_scale": float32 [T, G, 2, R], "tile_min": float32 [T, G, R]}``.
    Raises ValueError if ``K`` is not a multiple of 32."""
    n, k = codes.shape
    if k % GROUP:
        raise ValueError(f"Q8h tiles need K % {GROUP} == 0, got K = {k}")
    return {"tiles": torch.from_numpy(_quads(_tile(codes.numpy().reshape(n, k // GROUP, GROUP)))),
            "tile_scale": torch.from_numpy(_tile(scale.float().numpy().reshape(n, k // GROUP, 2))),
            "tile_min": torch.from_numpy(_tile(mins.float().numpy()))}


def q8h_linear(x: torch.Tensor, n: int, tiles: torch.Tensor, tile_scale: torch.Tensor,
               tile_min: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for float ``x`` ``[M, K]`` and the weight ``[n, K]`` in :func:`q8h_tiles` form: float32
    ``[M, n]``, on ``threads()`` threads."""
    return _run(_gemv_par if _threads > 1 else _gemv, x, n, tiles, tile_scale, tile_min)


def _group(codes, x_addr, scale_addr, min_addr, fx, sx, acc_addr):
    """One group of one tile into one row's accumulators (``codes``: the tile's group, an array). int8 codes:
    :func:`_q8h_group`; uint8 codes by their shape, so the layers of one role can each keep their own form
    (:func:`kernel_view`): ``[Q5_ROWS, 2R]`` :func:`_q5_group`, ``[8, 4R]`` (Q8h's bytes) :func:`_q8h_group`,
    ``[8, 2R]`` :func:`_q4_group`."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(_group, inline="always", jit_options={"nogil": True, "cache": True, "fastmath": False})
def _group_impl(codes, x_addr, scale_addr, min_addr, fx, sx, acc_addr):
    if codes.dtype == types.uint8:   # Q4 (8 x 2R), Q5 (Q5_ROWS x 2R) or Q8h's bytes (8 x 4R): one layer's form
        def any_form(codes, x_addr, scale_addr, min_addr, fx, sx, acc_addr):
            if codes.shape[0] == Q5_ROWS:
                _q5_group(codes.ctypes.data, x_addr, scale_addr, min_addr, fx, sx, acc_addr)
            elif codes.shape[1] == QUAD * TILE_ROWS:
                _q8h_group(codes.ctypes.data, x_addr, scale_addr, min_addr, fx, sx, acc_addr)
            else:
                _q4_group(codes.ctypes.data, x_addr, scale_addr, min_addr, fx, sx, acc_addr)
        return any_form
    return lambda codes, x_addr, scale_addr, min_addr, fx, sx, acc_addr: _q8h_group(
        codes.ctypes.data, x_addr, scale_addr, min_addr, fx, sx, acc_addr)


def _group2(codes, x_addr, x1_addr, scale_addr, min_addr, fx, sx, fx1, sx1, acc_addr, acc1_addr):
    """:func:`_group` for two rows at once (:func:`_q4_group2`, :func:`_q8h_group2`)."""
    raise NotImplementedError("only callable from numba-compiled code")


@overload(_group2, inline="always", jit_options={"nogil": True, "cache": True, "fastmath": False})
def _group2_impl(codes, x_addr, x1_addr, scale_addr, min_addr, fx, sx, fx1, sx1, acc_addr, acc1_addr):
    if codes.dtype == types.uint8:
        def any_form(codes, x_addr, x1_addr, scale_addr, min_addr, fx, sx, fx1, sx1, acc_addr, acc1_addr):
            if codes.shape[0] == Q5_ROWS:
                _q5_group2(codes.ctypes.data, x_addr, x1_addr, scale_addr, min_addr, fx, sx, fx1, sx1, acc_addr,
                           acc1_addr)
            elif codes.shape[1] == QUAD * TILE_ROWS:
                _q8h_group2(codes.ctypes.data, x_addr, x1_addr, scale_addr, min_addr, fx, sx, fx1, sx1, acc_addr,
                            acc1_addr)
            else:
                _q4_group2(codes.ctypes.data, x_addr, x1_addr, scale_addr, min_addr, fx, sx, fx1, sx1, acc_addr,
                           acc1_addr)
        return any_form
    return lambda codes, x_addr, x1_addr, scale_addr, min_addr, fx, sx, fx1, sx1, acc_addr, acc1_addr: _q8h_group2(
        codes.ctypes.data, x_addr, x1_addr, scale_addr, min_addr, fx, sx, fx1, sx1, acc_addr, acc1_addr)


@numba.njit(nogil=True, cache=True, fastmath=False)  # explicit: see the module docstring
def _gemv_tile(xq, fx, sx, codes, scale, mins, y, t, acc):
    """Tile ``t`` of :func:`_gemv` (its R output columns for every row), given the quantized activations;
    ``acc``: float32 [2, R] scratch."""
    M, G = xq.shape[0], codes.shape[1]
    for b in range(0, M - 1, 2):   # rows in pairs: one load of the codes serves both
        acc[:] = 0.0
        for g in range(G):
            _group2(codes[t, g], xq[b, g * GROUP:].ctypes.data, xq[b + 1, g * GROUP:].ctypes.data,
                    scale[t, g].ctypes.data, mins[t, g].ctypes.data, fx[b, g], sx[b, g], fx[b + 1, g],
                    sx[b + 1, g], acc[0].ctypes.data, acc[1].ctypes.data)
        y[b, t * TILE_ROWS:(t + 1) * TILE_ROWS] = acc[0]
        y[b + 1, t * TILE_ROWS:(t + 1) * TILE_ROWS] = acc[1]
    if M % 2:
        b = M - 1
        acc[0] = 0.0
        for g in range(G):
            _group(codes[t, g], xq[b, g * GROUP:].ctypes.data, scale[t, g].ctypes.data, mins[t, g].ctypes.data,
                   fx[b, g], sx[b, g], acc[0].ctypes.data)
        y[b, t * TILE_ROWS:(t + 1) * TILE_ROWS] = acc[0]


def kernel_view(kind: str, tiles: torch.Tensor, tile_scale: torch.Tensor,
                tile_min: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer's ``"int4"``, ``"int5"`` or ``"int8h"`` tiles as :func:`decode_layers` takes them, no copy: codes
    uint8 ``[T, G, P, W]``, scale and min float32 ``[T, G, R or 2R]`` (Q8h's codes as their bytes, its two scales
    per group side by side), so every form has one numba type and a role's layers can differ in form (Q4_K_M:
    Q4_K and Q6_K downs, Q5_0 and Q8_0 V rows); :func:`_group` tells them apart by shape."""
    codes, scale = tiles.numpy(), tile_scale.numpy()
    if kind == "int8h":
        codes, scale = codes.view(np.uint8), scale.reshape(scale.shape[0], scale.shape[1], -1)
    elif kind not in ("int4", "int5"):
        raise ValueError(f"no decode_layers tiles for a linear of kind {kind!r}")
    return codes, scale, tile_min.numpy()


@numba.njit(nogil=True, cache=True, fastmath=False)  # explicit: see the module docstring
def _gemv(x, codes, scale, mins, y):
    """y float32 [M, T * R] = x float32 [M, K] times the Q4 tiles (uint8 codes, layout in the module docstring)
    or the Q8h tiles (int8 codes, layout above)."""
    xq, fx, sx = _quantized(x)
    acc = np.empty((2, TILE_ROWS), np.float32)
    for t in range(codes.shape[0]):
        _gemv_tile(xq, fx, sx, codes, scale, mins, y, t, acc)


@numba.njit(nogil=True, cache=True, fastmath=False, parallel=True)  # explicit: see the module docstring
def _gemv_par(x, codes, scale, mins, y):
    """:func:`_gemv` with its tiles spread over numba's threads (``set_threads``): the same bits."""
    xq, fx, sx = _quantized(x)
    T = codes.shape[0]
    acc = np.empty((T, 2, TILE_ROWS), np.float32)
    for t in numba.prange(T):
        _gemv_tile(xq, fx, sx, codes, scale, mins, y, t, acc[t])


@numba.njit(nogil=True, cache=True, fastmath=False)  # explicit: see the module docstring
def _gemv_threads(x, codes, scale, mins, y, parallel):
    """:func:`_gemv_par` when ``parallel``, else :func:`_gemv` (a layer's linear in ``decode_layers``)."""
    if parallel:
        _gemv_par(x, codes, scale, mins, y)
    else:
        _gemv(x, codes, scale, mins, y)

