"""Causal attention over the paged KV pool on the CPU, in numba, as vector tiles: a native prefill's rows
(:func:`attend_rows`) and a decode step's row (:func:`attend_decode_row`, inside ``lowbit_cpu.decode_layers``).
Each query's bits depend on its own query and keys only.

Keys go in tiles of :data:`KEYS` (tile ``t`` = key positions ``KEYS t .. KEYS t + KEYS - 1``, aligned at position
0, a key per vector lane); every sum is a chain of explicit FMAs or adds in a fixed order::

    scores   prefill: per run of one sequence's rows and KV head, the keys transposed (``kt [tiles, D, KEYS]``) and
             the (row, head) queries QUERIES at a time, one FMA chain over d = 0..D-1 per query and key;
             decode: per query head, a key row's 16-dim chunks as one FMA chain per lane, then the lanes in a
             fixed tree (:func:`_pair_sums`), no transposing for one row
    weights  exp(score - max) at the query's own keys, 0 elsewhere; their sum per lane (position mod KEYS) in
             tile order, then a fixed tree over the lanes
    out      16 dims at a time, QUERIES queries per pass: one FMA chain over the keys in position order, / the sum

Why a query's bits do not move with the rows beside it, its prompt's packing or how much of it was cached: its
sums run in an order fixed by its own position (and window) alone: a lane is a key position modulo :data:`KEYS`,
a tile an absolute range of positions, and keys a query may not see (in tiles it shares with the other queries of
a pass) weigh an exact 0, so they add nothing (``fma(0, v, acc) == acc``; the pool holds finite K/V). The inner
loops are LLVM IR with explicit ``llvm.fma`` (no fast-math flags, so LLVM may not reorder them; the numba
functions say ``fastmath=False`` so that a fastmath caller's flags do not reach them); ``exp`` is Cephes'
``expf`` reduction and polynomial (~1 ulp), the same instructions in every lane. A prefill row and a decode row
at the same position differ in the last bits (their scores sum in other orders), as prefill's float32 GEMMs and
decode's int8 GEMVs already do. Head dims must be a multiple of 16 (:func:`supported`); ``gpu.model`` attends
with SDPA per row otherwise, and ``decode_layers`` with ``lowbit_cpu._attend``.

The pool is float32 or float16 (``kv_cache_dtype``; numba has no CPU float16, so its bits travel as uint16): a
float16 K/V row is widened exactly as it loads (:func:`to_f32`, ``fpext`` in the vector loads), so every sum
above runs in float32 on the same values whatever the rows beside it; :func:`from_f32` rounds a new K/V to the
pool's type (nearest even, as torch's ``.to(torch.float16)``).
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

__all__ = ["KEYS", "QUERIES", "attend_rows", "attend_decode_row", "from_f32", "supported", "to_f32"]

KEYS = 16      # keys per tile = vector lanes
QUERIES = 4    # queries sharing one pass over a tile (independent FMA chains)
_F32, _I32, _I64, _F16 = ir.FloatType(), ir.IntType(32), ir.IntType(64), ir.HalfType()
_VF = ir.VectorType(_F32, KEYS)
_VH = ir.VectorType(_F16, KEYS)


def _splat(builder, value, vector_type):
    """``value`` in every lane of ``vector_type``."""
    undef = ir.Constant(vector_type, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    lanes = vector_type.count
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, lanes), [0] * lanes))


def supported(head_dim: int) -> bool:
    """Whether :func:`attend_rows` and :func:`attend_decode_row` handle heads of ``head_dim`` (their scores and
    output run 16 dims per vector)."""
    return head_dim > 0 and head_dim % 16 == 0


def _fma(builder):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF, _VF, _VF]), "llvm.fma.v16f32")


def _at(builder, addr, offset, pointee):
    return builder.inttoptr(builder.add(addr, offset), pointee.as_pointer())


def _load_kv(builder, ptr_int, half):
    """16 float32 lanes of a K/V row at address ``ptr_int``: float32 as they are, or float16 widened (exact;
    ``vcvtph2ps`` where the CPU has F16C)."""
    if not half:
        return builder.load(builder.inttoptr(ptr_int, _VF.as_pointer()), align=4)
    return builder.fpext(builder.load(builder.inttoptr(ptr_int, _VH.as_pointer()), align=2), _VF)


@intrinsic
def to_f32(typingctx, x):
    """A K/V element as float32: a float16 carried as uint16 (the pool's float16 bits) widened exactly, a float32
    as it is."""
    if isinstance(x, types.Integer) and x.bitwidth == 16:
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], _F16), _F32)
        return types.float32(x), codegen
    if x == types.float32:
        return types.float32(x), lambda context, builder, signature, args: args[0]
    return None


@intrinsic
def from_f32(typingctx, x, like):
    """float32 ``x`` stored as an element of ``like``'s type: float16 bits (uint16; rounded to nearest even, as
    torch's and numpy's casts) or the float32 itself."""
    if isinstance(like, types.Integer) and like.bitwidth == 16 and x == types.float32:
        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.fptrunc(args[0], _F16), ir.IntType(16))
        return like(x, like), codegen
    if like == types.float32 and x == types.float32:
        return types.float32(x, like), lambda context, builder, signature, args: args[0]
    return None


def _lanes(values):
    return ir.Constant(_VF, [float(v) for v in values])


def _tree(builder, vec, combine):
    """Lane 0 of ``vec`` after lane i combines with lane i + h for h = KEYS/2, ..., 1: a fixed order."""
    h = KEYS // 2
    while h:
        moved = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, KEYS),
                                                             [(i + h) % KEYS for i in range(KEYS)]))
        vec = combine(vec, moved)
        h //= 2
    return builder.extract_element(vec, ir.Constant(_I32, 0))


def _exp(builder, x):
    """exp per lane for x <= 0: Cephes ``expf`` (n = floor(x log2 e + 1/2), x - n ln 2 in two parts, a degree-6
    polynomial, times 2^n built in the exponent bits); x below -87 counts as -87 (~1.6e-38, never 0 or
    subnormal); a NaN stays NaN (a NaN query's scores, or inf - inf)."""
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF]), "llvm.floor.v16f32")

    def c(v):
        return _lanes([v] * KEYS)

    nan, x = builder.fcmp_unordered("uno", x, x), builder.select(builder.fcmp_ordered(">", x, c(-87.0)), x, c(-87.0))
    n = builder.call(floor, [builder.fadd(builder.fmul(x, c(1.44269504088896341)), c(0.5))])
    r = builder.fsub(builder.fsub(x, builder.fmul(n, c(0.693359375))), builder.fmul(n, c(-2.12194440e-4)))
    p = c(1.9875691500e-4)
    for k in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = builder.fadd(builder.fmul(p, r), c(k))
    p = builder.fadd(builder.fadd(builder.fmul(p, builder.fmul(r, r)), r), c(1.0))
    vi = ir.VectorType(_I32, KEYS)
    bits = builder.shl(builder.add(builder.fptosi(n, vi), ir.Constant(vi, [127] * KEYS)), ir.Constant(vi, [23] * KEYS))
    return builder.select(nan, _lanes([float("nan")] * KEYS), builder.fmul(p, builder.bitcast(bits, _VF)))


@intrinsic
def _scores(typingctx, q0, q1, q2, q3, kt, dims, scale, o0, o1, o2, o3):
    """o_n[0:KEYS] = (sum_d q_n[d] kt[d, 0:KEYS]) * scale for the four queries at q0..q3 (float32 [dims]) over one
    transposed key tile (float32 [dims, KEYS]); each lane one FMA chain over d in order."""
    sig = types.void(*([types.intp] * 6), types.float32, *([types.intp] * 4))

    def codegen(context, builder, signature, args):
        queries, kta, dims, scale, outs = args[:4], args[4], args[5], args[6], args[7:]
        fma = _fma(builder)
        accs = [cgutils.alloca_once_value(builder, _lanes([0.0] * KEYS)) for _ in queries]
        with cgutils.for_range(builder, dims) as loop:
            k = builder.load(_at(builder, kta, builder.mul(loop.index, ir.Constant(_I64, 4 * KEYS)), _VF), align=4)
            for qa, acc in zip(queries, accs):
                x = builder.load(_at(builder, qa, builder.mul(loop.index, ir.Constant(_I64, 4)), _F32), align=4)
                builder.store(builder.call(fma, [_splat(builder, x, _VF), k, builder.load(acc)]), acc)
        scale = _splat(builder, scale, _VF)
        for oa, acc in zip(outs, accs):
            builder.store(builder.fmul(builder.load(acc), scale), builder.inttoptr(oa, _VF.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _weighted_values_for(half: bool):
    """:func:`_weighted_values` over a float32 (``half`` False) or float16 V pool."""

    @intrinsic
    def weighted_values(typingctx, w0, w1, w2, w3, slots, n, v_addr, slot_bytes, o0, o1, o2, o3):
        sig = types.void(*([types.intp] * 12))

        def codegen(context, builder, signature, args):
            weights, sa, n, va, stride, outs = args[:4], args[4], args[5], args[6], args[7], args[8:]
            fma = _fma(builder)
            accs = [cgutils.alloca_once_value(builder, _lanes([0.0] * KEYS)) for _ in weights]
            with cgutils.for_range(builder, n) as loop:
                j = loop.index
                slot = builder.load(_at(builder, sa, builder.mul(j, ir.Constant(_I64, 8)), _I64), align=8)
                v = _load_kv(builder, builder.add(va, builder.mul(slot, stride)), half)
                for wa, acc in zip(weights, accs):
                    w = builder.load(_at(builder, wa, builder.mul(j, ir.Constant(_I64, 4)), _F32), align=4)
                    builder.store(builder.call(fma, [_splat(builder, w, _VF), v, builder.load(acc)]), acc)
            for oa, acc in zip(outs, accs):
                builder.store(builder.load(acc), builder.inttoptr(oa, _VF.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return weighted_values


# o_n[0:16] = sum_j w_n[j] v(slots[j]) for j = 0..n-1 in order (one FMA chain per lane) for four weight rows
# (float32 [n]); v(s) = the 16 K/V elements (float32, or float16 widened) at ``v_addr + s * slot_bytes``; slots
# int64 [n]
_weighted_values, _weighted_values_h = _weighted_values_for(False), _weighted_values_for(True)


def _pair_sums(builder, x, y, width):
    """x and y hold KEYS / width keys each, ``width`` partial sums per key (key-major); returns one vector of
    x's keys then y's, ``width / 2`` partial sums each: a key's lane j + its lane j + width / 2."""
    half = width // 2
    lo = [k * width + j for k in range(KEYS // width) for j in range(half)]
    idx_lo = ir.Constant(ir.VectorType(_I32, KEYS), lo + [KEYS + i for i in lo])
    idx_hi = ir.Constant(ir.VectorType(_I32, KEYS), [i + half for i in lo] + [KEYS + i + half for i in lo])
    return builder.fadd(builder.shuffle_vector(x, y, idx_lo), builder.shuffle_vector(x, y, idx_hi))


def _dot_keys_for(half: bool):
    """:func:`_dot_keys` over a float32 (``half`` False) or float16 K pool."""

    @intrinsic
    def dot_keys(typingctx, q, k_addr, slots, slot_bytes, chunks, scale, o):
        sig = types.void(*([types.intp] * 5), types.float32, types.intp)

        def codegen(context, builder, signature, args):
            qa, ka, sa, stride, chunks, scale, oa = args
            fma = _fma(builder)
            rows = [builder.add(ka, builder.mul(builder.load(_at(builder, sa, ir.Constant(_I64, 8 * key), _I64),
                                                             align=8), stride)) for key in range(KEYS)]
            accs = [cgutils.alloca_once_value(builder, _lanes([0.0] * KEYS)) for _ in range(KEYS)]
            elem = 2 if half else 4
            with cgutils.for_range(builder, chunks) as loop:   # the chunks outside: KEYS independent FMA chains
                x = builder.load(_at(builder, qa, builder.mul(loop.index, ir.Constant(_I64, 64)), _VF), align=4)
                off = builder.mul(loop.index, ir.Constant(_I64, 16 * elem))
                for row, acc in zip(rows, accs):
                    k = _load_kv(builder, builder.add(row, off), half)
                    builder.store(builder.call(fma, [x, k, builder.load(acc)]), acc)
            partials = [builder.load(acc) for acc in accs]
            width = KEYS
            while len(partials) > 1:
                partials = [_pair_sums(builder, partials[i], partials[i + 1], width)
                            for i in range(0, len(partials), 2)]
                width //= 2
            builder.store(builder.fmul(partials[0], _splat(builder, scale, _VF)),
                          builder.inttoptr(oa, _VF.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return dot_keys


# o[0:KEYS] = (q . k(slots[j])) * scale for the KEYS keys of one tile, k(s) = the [16 chunks] K elements (float32,
# or float16 widened) at ``k_addr + s * slot_bytes``, q float32 [16 chunks]: per key, lane l sums q[16 c + l]
# k[16 c + l] over c in order (an FMA chain), then its 16 lanes add in a fixed tree (:func:`_pair_sums`, keys
# paired in order)
_dot_keys, _dot_keys_h = _dot_keys_for(False), _dot_keys_for(True)


@intrinsic
def _softmax_weights(typingctx, scores, weights, tiles, pos0, first, last):
    """Over ``tiles`` tiles of KEYS scores (float32, key positions pos0, pos0 + 1, ...): weights = exp(score -
    max) at positions first..last, else 0; returns their sum (per lane in tile order, then :func:`_tree`). The
    max is over first..last only (exact in any order)."""
    sig = types.float32(types.intp, types.intp, types.intp, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        sa, wa, tiles, pos0, first, last = args
        vi = ir.VectorType(_I64, KEYS)
        iota = ir.Constant(vi, list(range(KEYS)))
        zero, neg_inf = _lanes([0.0] * KEYS), _lanes([float("-inf")] * KEYS)
        first_v, last_v = _splat(builder, first, vi), _splat(builder, last, vi)

        def tile(t):   # (the lanes the query sees, the tile's byte offset)
            pos = builder.add(_splat(builder, builder.add(pos0, builder.mul(t, ir.Constant(_I64, KEYS))), vi), iota)
            seen = builder.and_(builder.icmp_signed(">=", pos, first_v), builder.icmp_signed("<=", pos, last_v))
            return seen, builder.mul(t, ir.Constant(_I64, 4 * KEYS))

        top = cgutils.alloca_once_value(builder, neg_inf)
        with cgutils.for_range(builder, tiles) as loop:
            seen, off = tile(loop.index)
            s, m = builder.load(_at(builder, sa, off, _VF), align=4), builder.load(top)
            builder.store(builder.select(builder.and_(seen, builder.fcmp_ordered(">", s, m)), s, m), top)
        top = _splat(builder, _tree(builder, builder.load(top),
                                    lambda a, b: builder.select(builder.fcmp_ordered(">", b, a), b, a)), _VF)
        total = cgutils.alloca_once_value(builder, zero)
        with cgutils.for_range(builder, tiles) as loop:
            seen, off = tile(loop.index)
            s = builder.load(_at(builder, sa, off, _VF), align=4)
            e = builder.select(seen, _exp(builder, builder.fsub(s, top)), zero)
            builder.store(e, _at(builder, wa, off, _VF), align=4)
            builder.store(builder.fadd(builder.load(total), e), total)
        return _tree(builder, builder.load(total), builder.fadd)

    return sig, codegen


@numba.njit(nogil=True, cache=True, fastmath=False)
def _first_key(p, window):
    return max(0, p + 1 - window) if window > 0 else 0


@numba.njit(nogil=True, cache=True, fastmath=False)
def _tile_slots(table, block_tokens, base, n, last, slots):
    """slots[j] = the pool slot of key position base + j for j < n; past ``last`` (the last key), last's slot:
    a real key (finite K/V) that weighs 0."""
    for j in range(n):
        s = min(base + j, last)
        slots[j] = table[s // block_tokens] * block_tokens + s % block_tokens


@numba.njit(nogil=True, cache=True, fastmath=False)
def _values(w0, w1, w2, w3, slots, n, pool_v, kvh, acc):
    """acc[m, :] = sum_j w_m[j] V[slots[j], kvh, :] over j < n (``_weighted_values`` 16 dims at a time) for the
    four weight rows at addresses w0..w3; pool_v float32, or float16 bits (uint16)."""
    for c in range(0, acc.shape[1], 16):
        if pool_v.itemsize == 2:
            _weighted_values_h(w0, w1, w2, w3, slots, n, pool_v[0, kvh, c:].ctypes.data, pool_v.strides[0],
                               acc[0, c:].ctypes.data, acc[1, c:].ctypes.data, acc[2, c:].ctypes.data,
                               acc[3, c:].ctypes.data)
        else:
            _weighted_values(w0, w1, w2, w3, slots, n, pool_v[0, kvh, c:].ctypes.data, pool_v.strides[0],
                             acc[0, c:].ctypes.data, acc[1, c:].ctypes.data, acc[2, c:].ctypes.data,
                             acc[3, c:].ctypes.data)


@numba.njit(nogil=True, cache=True, fastmath=False)
def _run(q, pool_k, pool_v, table, block_tokens, positions, window, attn_scale, r0, r1, out, kt, slots, sc, w,
         acc, totals):
    """Rows r0..r1-1 (one sequence, ``table`` its block ids) of :func:`attend_rows`, with its scratch."""
    H, D = q.shape[1], q.shape[2]
    Hkv = pool_k.shape[1]
    group = H // Hkv
    lo, hi = np.int64(1) << 62, np.int64(0)
    for r in range(r0, r1):
        lo, hi = min(lo, _first_key(positions[r], window)), max(hi, positions[r] + 1)
    t_lo = lo // KEYS
    n_tiles = (hi + KEYS - 1) // KEYS - t_lo
    base = t_lo * KEYS
    _tile_slots(table, block_tokens, base, n_tiles * KEYS, hi - 1, slots)
    n_queries = (r1 - r0) * group   # query k: row r0 + k // group, head kvh * group + k % group
    scale = np.float32(attn_scale)
    for kvh in range(Hkv):
        for t in range(n_tiles):
            for lane in range(KEYS):
                key = pool_k[slots[t * KEYS + lane], kvh]
                for d in range(D):
                    kt[t, d, lane] = to_f32(key[d])
        for k0 in range(0, n_queries, QUERIES):
            ks = (k0, min(k0 + 1, n_queries - 1), min(k0 + 2, n_queries - 1), min(k0 + 3, n_queries - 1))
            q_lo, q_hi = hi, np.int64(0)
            for k in ks:
                p = positions[r0 + k // group]
                q_lo, q_hi = min(q_lo, _first_key(p, window)), max(q_hi, p + 1)
            a, b = q_lo // KEYS - t_lo, (q_hi + KEYS - 1) // KEYS - t_lo   # the tiles any of the four sees
            qa = (q[r0 + ks[0] // group, kvh * group + ks[0] % group].ctypes.data,
                  q[r0 + ks[1] // group, kvh * group + ks[1] % group].ctypes.data,
                  q[r0 + ks[2] // group, kvh * group + ks[2] % group].ctypes.data,
                  q[r0 + ks[3] // group, kvh * group + ks[3] % group].ctypes.data)
            for t in range(a, b):
                _scores(qa[0], qa[1], qa[2], qa[3], kt[t].ctypes.data, D, scale, sc[0, t * KEYS:].ctypes.data,
                        sc[1, t * KEYS:].ctypes.data, sc[2, t * KEYS:].ctypes.data, sc[3, t * KEYS:].ctypes.data)
            for m in range(QUERIES):
                p = positions[r0 + ks[m] // group]
                totals[m] = _softmax_weights(sc[m, a * KEYS:].ctypes.data, w[m, a * KEYS:].ctypes.data, b - a,
                                             base + a * KEYS, _first_key(p, window), p)
            _values(w[0, a * KEYS:].ctypes.data, w[1, a * KEYS:].ctypes.data, w[2, a * KEYS:].ctypes.data,
                    w[3, a * KEYS:].ctypes.data, slots[a * KEYS:].ctypes.data, (b - a) * KEYS, pool_v, kvh, acc)
            for m in range(min(QUERIES, n_queries - k0)):
                k = k0 + m
                row, head = r0 + k // group, kvh * group + k % group
                for d in range(D):
                    out[row, head, d] = acc[m, d] / totals[m]


@numba.njit(nogil=True, cache=True, fastmath=False)
def attend_rows(q, pool_k, pool_v, tables, block_tokens, seq, positions, window, attn_scale, out):
    """Causal attention of a prefill's rows over the pool, each query on its own (module docstring): out float32
    [N, H, D] for q float32 [N, H, D] (C-contiguous); pool_k, pool_v [slots, Hkv, D], float32 or float16 bits
    (uint16; :func:`to_f32` widens them exactly, so a float16 pool attends as its float32 image) (the rows' own K/V
    already written; slot = block * block_tokens + offset; a slot's [Hkv, D] contiguous); tables int64 [B,
    blocks] (padded); seq int64 [N] the row's sequence; positions int64 [N] its position p: it attends over its
    sequence's keys 0..p, or with ``window`` > 0 over p - window < j <= p; attn_scale float32. H a multiple of
    Hkv, D of 16 (:func:`supported`). Consecutive rows of one sequence share their key tiles. A row's bits do not
    depend on the other rows of the call, how its prompt was packed or how much of it was cached. Nothing is
    checked here."""
    N, D = q.shape[0], q.shape[2]
    if N == 0:
        return
    n_keys = (np.max(positions) // KEYS + 1) * KEYS
    kt = np.empty((n_keys // KEYS, D, KEYS), np.float32)
    slots = np.empty(n_keys, np.int64)
    sc = np.empty((QUERIES, n_keys), np.float32)
    w = np.empty((QUERIES, n_keys), np.float32)
    acc = np.empty((QUERIES, D), np.float32)
    totals = np.empty(QUERIES, np.float32)
    r0 = 0
    while r0 < N:
        r1 = r0 + 1
        while r1 < N and seq[r1] == seq[r0]:
            r1 += 1
        _run(q, pool_k, pool_v, tables[seq[r0]], block_tokens, positions, window, attn_scale, r0, r1, out, kt,
             slots, sc, w, acc, totals)
        r0 = r1


@numba.njit(nogil=True, cache=True, fastmath=False)  # explicit: a fastmath caller must not lend its flags
def attend_decode_row(q, pool_k, pool_v, table, block_tokens, first, length, attn_scale, out):
    """out [H, D] = softmax(q K^T * attn_scale) V over keys ``first .. length - 1`` of one sequence, for a decode
    step's row: q float32 [H, D] (H a multiple of Hkv, D of 16); pool_k, pool_v [slots, Hkv, D], float32 or
    float16 bits (uint16), as in :func:`attend_rows`; table
    its block ids. Per KV head, each query head's scores run :func:`_dot_keys` over tiles of KEYS keys (aligned
    at position 0), then :func:`_softmax_weights` and :func:`_values` as in :func:`attend_rows`: every sum's
    order is fixed by ``first`` and ``length`` alone."""
    H, D = q.shape
    Hkv = pool_k.shape[1]
    group = H // Hkv
    t_lo = first // KEYS
    n_tiles = (length + KEYS - 1) // KEYS - t_lo
    base = t_lo * KEYS
    slots = np.empty(n_tiles * KEYS, np.int64)
    _tile_slots(table, block_tokens, base, n_tiles * KEYS, length - 1, slots)
    sc = np.empty((QUERIES, n_tiles * KEYS), np.float32)
    w = np.empty((QUERIES, n_tiles * KEYS), np.float32)
    acc = np.empty((QUERIES, D), np.float32)
    totals = np.empty(QUERIES, np.float32)
    scale = np.float32(attn_scale)
    for kvh in range(Hkv):
        for h0 in range(0, group, QUERIES):
            heads = min(QUERIES, group - h0)   # a short pass repeats its last head's weights (output unused)
            for m in range(heads):
                qa = q[kvh * group + h0 + m].ctypes.data
                for t in range(n_tiles):
                    if pool_k.itemsize == 2:
                        _dot_keys_h(qa, pool_k[0, kvh].ctypes.data, slots[t * KEYS:].ctypes.data,
                                    pool_k.strides[0], D // 16, scale, sc[m, t * KEYS:].ctypes.data)
                    else:
                        _dot_keys(qa, pool_k[0, kvh].ctypes.data, slots[t * KEYS:].ctypes.data, pool_k.strides[0],
                                  D // 16, scale, sc[m, t * KEYS:].ctypes.data)
                totals[m] = _softmax_weights(sc[m].ctypes.data, w[m].ctypes.data, n_tiles, base, first, length - 1)
            _values(w[0].ctypes.data, w[min(1, heads - 1)].ctypes.data, w[min(2, heads - 1)].ctypes.data,
                    w[min(3, heads - 1)].ctypes.data, slots.ctypes.data, n_tiles * KEYS, pool_v, kvh, acc)
            for m in range(heads):
                for d in range(D):
                    out[kvh * group + h0 + m, d] = acc[m, d] / totals[m]
