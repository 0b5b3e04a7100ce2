"""Torch implementations of what the numba kernels compute: the references they are tested against, and the
torch baselines ``bench/gpu.py`` times them against. Plain torch, any device, no numba import.

Shapes follow the KV pool of ``gpu/model.py`` (vLLM's PagedAttention layout)::

    pool:  [num_layers, 2, num_blocks, block_tokens, num_kv_heads, head_dim]    axis 1: 0 = K, 1 = V
    kv:    pool[layer] = [2, num_blocks, block_tokens, num_kv_heads, head_dim]

Token ``p`` of a sequence lives in block ``block_table[p // block_tokens]`` at offset ``p % block_tokens``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _check_decode_args(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor) -> None:
    if q.dim() != 3 or kv.dim() != 5 or kv.shape[0] != 2:
        raise ValueError(f"q must be [B, H, D] and kv [2, num_blocks, block_tokens, Hkv, D]; got "
                         f"{list(q.shape)} and {list(kv.shape)}")
    B, H, D = q.shape
    Hkv = kv.shape[3]
    if kv.shape[4] != D or H % Hkv:
        raise ValueError(f"head_dim {D} vs {kv.shape[4]}, heads {H} must be a multiple of kv heads {Hkv}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError(f"block_tables must be [B={B}, max_blocks] and seq_lens [B]; got "
                         f"{list(block_tables.shape)} and {list(seq_lens.shape)}")


def paged_attention_decode_ref(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """The exact answer, computed per sequence in float64 (slow; tests only).

    Args:
        q: ``[B, H, D]`` one query token per sequence.
        kv: ``[2, num_blocks, block_tokens, Hkv, D]`` one layer of the pool; ``H % Hkv == 0`` (GQA: query
            head ``h`` reads kv head ``h // (H // Hkv)``).
        block_tables: ``[B, max_blocks]`` integer block ids (entries past a sequence's length are ignored).
        seq_lens: ``[B]`` number of keys each query attends to (>= 1).
        scale: softmax scale, default ``1 / sqrt(D)``.
    Returns:
        ``[B, H, D]`` float32.
    """
    _check_decode_args(q, kv, block_tables, seq_lens)
    B, H, D = q.shape
    bt, Hkv = kv.shape[2], kv.shape[3]
    G = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.empty(B, H, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(seq_lens[b])
        pos = torch.arange(n, device=kv.device)
        blocks = block_tables[b].to(kv.device).long()[pos // bt]  # [n]
        k = kv[0, blocks, pos % bt].double()  # [n, Hkv, D]
        v = kv[1, blocks, pos % bt].double()  # [n, Hkv, D]
        k = k.repeat_interleave(G, dim=1)  # [n, H, D]
        v = v.repeat_interleave(G, dim=1)  # [n, H, D]
        s = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale  # [H, n]
        p = torch.softmax(s, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v).float()
    return out


def paged_attention_decode_torch(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor,
                                 seq_lens: torch.Tensor, *, scale: float | None = None,
                                 max_seq_len: int | None = None) -> torch.Tensor:
    """The torch path of ``LlamaModel.decode``: gather every sequence's K/V from its blocks into a padded
    ``[B, Hkv, S, D]`` copy (one ``index_select`` each), then ``F.scaled_dot_product_attention`` with GQA and
    a length mask. Same arguments as :func:`paged_attention_decode_ref`; returns ``[B, H, D]`` in q's dtype.
    ``max_seq_len`` (the longest ``seq_lens``) saves a device->host read when given.
    """
    _check_decode_args(q, kv, block_tables, seq_lens)
    B, H, D = q.shape
    bt, Hkv = kv.shape[2], kv.shape[3]
    S = int(seq_lens.max()) if max_seq_len is None else int(max_seq_len)
    dev = kv.device
    ctx = torch.arange(S, device=dev)  # [S]
    tables = block_tables.to(dev).long()
    lens = seq_lens.to(dev).long()
    valid = ctx[None, :] < lens[:, None]  # [B, S]
    # Padded positions read slot 0 of the sequence's first block: finite, and masked out below.
    blk = torch.where(valid, tables[:, (ctx // bt).clamp(max=tables.shape[1] - 1)], tables[:, :1])  # [B, S]
    slot = (blk * bt + torch.where(valid, ctx % bt, 0)).reshape(-1)  # [B S]
    flat = kv.reshape(2, -1, Hkv, D)  # [2, num_blocks * block_tokens, Hkv, D]
    k = flat[0].index_select(0, slot).view(B, S, Hkv, D).transpose(1, 2).to(q.dtype)  # [B, Hkv, S, D]
    v = flat[1].index_select(0, slot).view(B, S, Hkv, D).transpose(1, 2).to(q.dtype)  # [B, Hkv, S, D]
    mask = valid[:, None, None, :]  # [B, 1, 1, S]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=True)  # [B, H, 1, D]
    return o[:, :, 0]


def dense_attention_decode_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                                 scale: float | None = None) -> torch.Tensor:
    """SDPA over K/V already contiguous per sequence (no paging, no gather, equal lengths): the floor a
    paged kernel is measured against. q: ``[B, H, D]``; k, v: ``[B, Hkv, S, D]``; returns ``[B, H, D]``."""
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)[:, :, 0]


def copy_blocks_ref(src_pool: torch.Tensor, dst_pool: torch.Tensor, src_ids, dst_ids) -> None:
    """``dst_pool[:, :, dst_ids[i]] = src_pool[:, :, src_ids[i]]`` for every i: all layers, K and V.

    Pools are ``[num_layers, 2, num_blocks, block_tokens, Hkv, D]`` with equal geometry except num_blocks.
    One ``index_select`` + one ``index_copy_`` (two launches on a GPU, with a temporary).
    """
    dev = dst_pool.device
    s = torch.as_tensor(src_ids, dtype=torch.long).to(src_pool.device)
    d = torch.as_tensor(dst_ids, dtype=torch.long).to(dev)
    dst_pool.index_copy_(2, d, src_pool.index_select(2, s).to(dev))


def linear_ref(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ w.T`` in float32 (``F.linear`` without bias): a ``[M, K]``, w ``[N, K]`` -> ``[M, N]``."""
    return a.float() @ w.float().T
