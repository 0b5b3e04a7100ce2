"""The CPU KV handoff's copy loop: whole blocks between two pools' byte views, compiled with numba.

``ipc.kv_transport.CpuShmTransport`` calls ``copy_blocks`` (and bench/ipc, to compare); only they import
this module: numba's import and loading the cached machine code cost 1-3 s, paid at actor start, not on a
request's path. The loop is shaped by what `python -m bench.ipc --only kv` measures.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

STREAM_ALIGN_BYTES = 64   # one cache line: the unit of a streaming (non-temporal) store below


@intrinsic
def _stream_line(typingctx, dst_addr, src_addr):
    """Copy the 64 bytes at ``src_addr`` to ``dst_addr`` with a non-temporal store (both 64-byte aligned)."""
    sig = types.void(types.intp, types.intp)

    def codegen(context, builder, signature, args):
        line = ir.VectorType(ir.IntType(64), 8)
        src = builder.inttoptr(args[1], line.as_pointer())
        dst = builder.inttoptr(args[0], line.as_pointer())
        store = builder.store(builder.load(src, align=64), dst, align=64)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.IntType(32)(1)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _store_fence(typingctx):
    """A full fence: non-temporal stores are weakly ordered, so they are made visible before the copy returns
    (the caller then tells another process the blocks are there)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(nogil=True, cache=True)
def copy_blocks(src, dst, src_ids, dst_ids, stream):
    """``dst[p, dst_ids[i]] = src[p, src_ids[i]]`` for every plane ``p`` and every ``i``.

    src, dst: uint8 ``[planes, blocks, piece_bytes]`` C-contiguous views of two pools (plane = one layer's K or
    V; a piece is one block of one plane, block_tokens * kv_heads * head_dim * dtype bytes). src_ids, dst_ids:
    int64 ``[n]``, already validated (no bounds checks here), best sorted by source id. Plane-outer, block-inner:
    the pieces read one after another lie in one plane, so their page-table entries are neighbours.
    ``stream``: copy with non-temporal stores; the caller sets it only when piece_bytes and both views' data
    are ``STREAM_ALIGN_BYTES``-aligned. Raises numba's TypingError for arrays of another dtype or rank.
    """
    piece = src.shape[2]
    for p in range(src.shape[0]):
        for i in range(src_ids.shape[0]):
            s = src[p, src_ids[i]]
            d = dst[p, dst_ids[i]]
            if stream:
                s_addr, d_addr = s.ctypes.data, d.ctypes.data
                for off in range(0, piece, 64):
                    _stream_line(d_addr + off, s_addr + off)
            else:
                for k in range(piece):
                    d[k] = s[k]
    if stream:
        _store_fence()


def byte_planes(arr: np.ndarray) -> np.ndarray:
    """A pool's ``[layers, 2, blocks, ...]`` array as uint8 ``[layers * 2, blocks, piece_bytes]`` (a view)."""
    return arr.reshape(arr.shape[0] * arr.shape[1], arr.shape[2], -1).view(np.uint8)
