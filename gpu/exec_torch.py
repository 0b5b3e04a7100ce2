"""The dense torch path: every layer in plain torch ops on any torch device (CPU float32/bfloat16, CUDA).

| piece | what |
|---|---|
| :class:`TorchExecutor` | ``prefill_packed`` and ``decode`` of a GQA model over the paged pool; the hooks the other paths override: ``linear``, ``attention_plan`` / ``attend_prefill``, ``attend_decode``, ``prefill_head`` |
| :class:`DecodeStep` | one decode step's index tensors (written slots, read slots, masks), shared by every layer |

An executor holds its model (``gpu.model.LlamaModel``: weights, config, knobs, argument checks, the layer math of
gpu/layers.py) and is chosen once when the model is built (``LlamaModel.executor``). Prefill attention is SDPA per
packed sequence over its own context; decode gathers each row's context from the pool, padded to the longest row
with a mask, and runs one SDPA over the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .quant import QuantLinear

__all__ = ["DecodeStep", "TorchExecutor"]


@dataclass
class DecodeStep:
    """Index tensors of one decode step of ``B`` rows, every row's keys padded to ``S = max(positions) + 1``."""

    B: int
    S: int
    positions: list[int]  # [B]
    padded: list[list[int]]  # [B][blocks]: each row's block table padded with its first block
    pos_t: torch.Tensor  # [B] int64 positions
    w_slot: torch.Tensor  # [B] the pool slot each new token's K/V is written to
    r_slot: torch.Tensor  # [B S] the slot each row's key j is read from (padded keys: the row's slot (block, 0))
    masks: dict[int, torch.Tensor | None]  # window (0 = global) -> [B, 1, 1, S] bool (True = attend) or None
    big: bool  # the linears run their prefill-sized form (``QuantLinear.big``)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # what another path's hooks add (gpu/exec_cuda.py)


class TorchExecutor:
    """Dense torch over the model's weights, on the model's device, in its dtype."""

    name = "torch"

    def __init__(self, model: Any):
        self.m = model

    # -- hooks --------------------------------------------------------------------------------------------

    def linear(self, lin: QuantLinear, x: torch.Tensor, big: bool) -> torch.Tensor:
        """``lin`` over ``x`` ``[N, K]`` -> ``[N, out]``: its prefill-sized form when ``big``, else its own."""
        return lin.big(x) if big else lin.fn(x)

    def attention_plan(self, kv: torch.Tensor, seqs: list[tuple], w_slot: torch.Tensor, pos: torch.Tensor,
                       tables: list[list[int]]) -> Any:
        """What :meth:`attend_prefill` needs beyond its arguments, once per pass (nothing here)."""
        return None

    def attend_prefill(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                       v_pool: torch.Tensor, seqs: list[tuple], plan: Any) -> torch.Tensor:
        """Prefill attention of layer ``li``: q ``[N, H, D]``, k/v ``[N, Hkv, D]`` (already in the pools
        ``[slots, Hkv, D]``). Returns ``[N, H D]``."""
        return self.attend_packed(q, k, v, k_pool, v_pool, seqs, self.m._windows[li])

    def attend_decode(self, li: int, q: torch.Tensor, kv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                      step: DecodeStep) -> torch.Tensor:
        """Decode attention of layer ``li``: q ``[B, H, D]`` over each row's keys (the new ones already in the
        pools ``[slots, Hkv, D]``; ``kv`` the whole pool). Returns ``[B, H, 1, D]`` (any shape of ``B * H * D``)."""
        c, m = self.m.config, self.m
        B, S, Hkv, D = step.B, step.S, c.num_kv_heads, c.head_dim
        # strided views, no copies: SDPA gives the same bits as on contiguous K/V and is 10-40% cheaper
        kc = k_pool.index_select(0, step.r_slot).to(m.dtype).view(B, S, Hkv, D).transpose(1, 2)
        vc = v_pool.index_select(0, step.r_slot).to(m.dtype).view(B, S, Hkv, D).transpose(1, 2)
        # kc, vc: [B, Hkv, S, D]
        return m._attention(q.unsqueeze(2), kc, vc, step.masks[m._windows[li]])  # [B, H, 1, D]

    def prefill_head(self, x: torch.Tensor, big: bool) -> torch.Tensor:
        """The output projection of a prefill's normed rows ``x`` ``[rows, hidden]`` -> ``[rows, vocab]``."""
        return self.m._linear(self.m.lm_head, x, big)

    # -- prefill ------------------------------------------------------------------------------------------

    def prefill_packed(self, kv: torch.Tensor, token_ids: list[list[int]], block_tables: list[list[int]],
                       start_positions: list[int], all_logits: list[bool] | None,
                       logits: list[bool] | None, hidden: list[bool] | None = None) -> list[torch.Tensor | None]:
        """``gpu.model.LlamaModel.prefill_packed`` (arguments checked there too)."""
        m = self.m
        c = m.config
        flags, seqs, w_slot, pos, tables = m._packed_start(kv, token_ids, block_tables, start_positions, all_logits)
        N = sum(len(ids) for ids in token_ids)
        kv_flat = m._flat_pool(kv)  # [L, 2, slots, Hkv, D]
        rope = m._rope_at(pos)
        plan = self.attention_plan(kv, seqs, w_slot, pos, tables)

        ids = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long, device=m.device)
        x = m._embed(ids)  # x: [N, hidden]
        big = N >= m.dense_min_tokens
        eps = c.rms_norm_eps
        for li, layer in enumerate(m.layers):
            h = F.rms_norm(x, (c.hidden_size,), layer.ln_attn, eps)  # h: [N, hidden]
            q, k, v = m._qkv(li, layer, h, rope, big)  # q: [N, H, D]; k, v: [N, Hkv, D]
            k_pool, v_pool = kv_flat[li, 0], kv_flat[li, 1]  # [slots, Hkv, D] each
            k_pool.index_copy_(0, w_slot, k.to(kv.dtype))
            v_pool.index_copy_(0, w_slot, v.to(kv.dtype))
            o = self.attend_prefill(li, q, k, v, k_pool, v_pool, seqs, plan)  # o: [N, H D]
            x = m._layer_rest(layer, x, o, big)  # x: [N, hidden]
        return self.packed_logits(x, seqs, flags, big, logits, hidden)

    def packed_logits(self, x: torch.Tensor, seqs: list[tuple], flags: list[bool], big: bool,
                      wanted: list[bool] | None = None, hidden: list[bool] | None = None) -> list[torch.Tensor | None]:
        """``prefill_packed``'s return from the last layer's output ``x`` ``[N, hidden]``: only the rows whose
        logits are asked for go through the norm and the LM head (``wanted``: its ``logits`` flags); a sequence
        flagged in ``hidden`` gets its rows after the final norm ``[T, hidden]`` (float32) instead, normed in a
        call of their own (the logit rows' bits do not depend on them)."""
        if hidden is None or not any(hidden):
            return self._logits(x, seqs, flags, big, wanted)
        m = self.m
        out = self._logits(x, seqs, flags, big, [w and not h for w, h in zip(wanted or [True] * len(seqs), hidden)])
        rows = [range(a, b) if h else range(0) for (a, b, *_), h in zip(seqs, hidden)]
        normed = F.rms_norm(x[torch.tensor([i for r in rows for i in r], dtype=torch.long, device=m.device)],
                            (m.config.hidden_size,), m.norm, m.config.rms_norm_eps).float()  # [rows, hidden]
        for b, part in enumerate(normed.split([len(r) for r in rows])):
            if hidden[b]:
                out[b] = part
        return out

    def _logits(self, x: torch.Tensor, seqs: list[tuple], flags: list[bool], big: bool,
                wanted: list[bool] | None) -> list[torch.Tensor | None]:
        """:meth:`packed_logits` without hidden states: the norm and the LM head over the wanted rows."""
        m = self.m
        wanted = [True] * len(seqs) if wanted is None else wanted
        rows = [range(a, b) if f else range(b - 1, b) if w else range(0) for (a, b, *_), f, w in
                zip(seqs, flags, wanted)]
        if not any(rows):
            return [None] * len(seqs)
        x = x[torch.tensor([i for r in rows for i in r], dtype=torch.long, device=m.device)]
        x = F.rms_norm(x, (m.config.hidden_size,), m.norm, m.config.rms_norm_eps)
        logits = m._softcap_logits(self.prefill_head(x, big).float())  # [rows, vocab]
        parts = logits.split([len(r) for r in rows])
        return [part if f else part[0] if len(part) else None for part, f in zip(parts, flags)]

    def attend_packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                      v_pool: torch.Tensor, seqs: list[tuple], window: int = 0) -> torch.Tensor:
        """Causal attention of each packed sequence over its own context; q ``[N, H, D]``, k/v ``[N, Hkv, D]``
        (already written to ``k_pool``/``v_pool`` ``[slots, Hkv, D]``); ``window`` > 0: a query at position ``p``
        sees keys at ``p - window < j <= p`` only. Returns ``[N, H * D]``."""
        m = self.m
        pool_dtype = k_pool.dtype
        outs = []
        for a, b, r_slot, mask, pos in seqs:
            qh = q[a:b].transpose(0, 1).unsqueeze(0).contiguous()  # qh: [1, H, T, D]
            if r_slot is None:
                # The values the pool now holds (rounded through the pool dtype when it differs).
                kc = k[a:b].to(pool_dtype).to(m.dtype).transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hkv, T, D]
                vc = v[a:b].to(pool_dtype).to(m.dtype).transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hkv, T, D]
                ctx = pos  # the sequence starts at position 0: its keys are its own tokens
                mask = (ctx[None, :] <= pos[:, None]) if window else None  # [T, T]
            else:
                kc = k_pool.index_select(0, r_slot).to(m.dtype).transpose(0, 1).unsqueeze(0).contiguous()
                vc = v_pool.index_select(0, r_slot).to(m.dtype).transpose(0, 1).unsqueeze(0).contiguous()
                # kc, vc: [1, Hkv, S, D]
                ctx = torch.arange(kc.shape[2], device=m.device)  # [S]
            if window:
                mask = mask & (ctx[None, :] > pos[:, None] - window)  # [T, S]
            o = m._attention(qh, kc, vc, mask, causal=r_slot is None)  # o: [1, H, T, D]
            outs.append(o[0].transpose(0, 1).reshape(b - a, -1))  # [T, H D]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    # -- decode -------------------------------------------------------------------------------------------

    def decode(self, kv: torch.Tensor, token_ids: list[int], positions: list[int],
               block_tables: list[list[int]]) -> torch.Tensor:
        """``gpu.model.LlamaModel.decode``: logits ``[B, vocab]``."""
        padded, w_blk = self.m._decode_tables(kv, token_ids, positions, block_tables)
        return self.decode_layers(kv, token_ids, self.decode_step(kv, positions, padded, w_blk))

    def decode_step(self, kv: torch.Tensor, positions: list[int], padded: list[list[int]],
                    w_blk: list[int]) -> DecodeStep:
        """The :class:`DecodeStep` of checked arguments (``padded``, ``w_blk`` from ``_decode_tables``)."""
        m = self.m
        B, bt_size, dev = len(positions), kv.shape[3], m.device
        S = max(positions) + 1  # keys per sequence after padding
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)  # [B]
        w_slot = torch.tensor(w_blk, dtype=torch.long, device=dev) * bt_size + pos_t % bt_size  # [B]
        ctx = torch.arange(S, device=dev)  # [S]
        r_blk = torch.tensor(padded, dtype=torch.long, device=dev)[:, ctx // bt_size]  # [B, S]
        valid = ctx[None, :] <= pos_t[:, None]  # [B, S]
        if min(positions) == S - 1:  # every sequence has the same length: no padding, no mask
            masks: dict[int, torch.Tensor | None] = {0: None}
            r_slot = (r_blk * bt_size + ctx % bt_size).reshape(-1)  # [B S]
        else:
            # Padded keys read slot (block, 0) of their own sequence: written, so finite under the mask.
            r_slot = (r_blk * bt_size + torch.where(valid, ctx % bt_size, 0)).reshape(-1)  # [B S]
            masks = {0: valid[:, None, None, :]}  # [B, 1, 1, S]
        for wnd in set(m._windows) - {0}:  # sliding layers: keys p - window < j <= p
            masks[wnd] = (valid & (ctx[None, :] > pos_t[:, None] - wnd))[:, None, None, :]  # [B, 1, 1, S]
        # the float32 copies only where lowbit_cpu.decode_layers would not run
        big = B >= m.decode_stacked_max_rows
        return DecodeStep(B, S, list(positions), padded, pos_t, w_slot, r_slot, masks, big)

    def decode_layers(self, kv: torch.Tensor, token_ids: list[int], step: DecodeStep) -> torch.Tensor:
        """Every layer of a decode step, op by op, then the final norm and the LM head: logits ``[B, vocab]``."""
        m = self.m
        c = m.config
        B, H, D = step.B, c.num_heads, c.head_dim
        kv_flat = m._flat_pool(kv)  # [L, 2, slots, Hkv, D]
        rope = m._rope_at(step.pos_t)
        ids = torch.tensor(token_ids, dtype=torch.long, device=m.device)
        x = m._embed(ids)  # x: [B, hidden], a fresh tensor: the residual adds below run in place
        eps, hidden = c.rms_norm_eps, (c.hidden_size,)
        for li, layer in enumerate(m.layers):
            h = F.rms_norm(x, hidden, layer.ln_attn, eps)  # h: [B, hidden]
            q, k, v = m._qkv(li, layer, h, rope, step.big)  # q: [B, H, D]; k, v: [B, Hkv, D]
            k_pool, v_pool = kv_flat[li, 0], kv_flat[li, 1]  # [slots, Hkv, D] each
            k_pool.index_copy_(0, step.w_slot, k.to(kv.dtype))
            v_pool.index_copy_(0, step.w_slot, v.to(kv.dtype))
            o = self.attend_decode(li, q, kv, k_pool, v_pool, step)  # o: [B, H, 1, D]
            x = m._layer_rest(layer, x, o.reshape(B, H * D), step.big)  # x: [B, hidden]
        x = F.rms_norm(x, hidden, m.norm, eps)
        return m._softcap_logits(m._linear(m.lm_head, x, B >= m.head_dense_min_rows).float())  # [B, vocab]
