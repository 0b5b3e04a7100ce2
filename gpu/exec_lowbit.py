"""The native low-bit path on CPU: GGUF Q4/Q8/K-quant linears kept packed (gpu/quant.py, gpu/lowbit_cpu.py).

| piece | what |
|---|---|
| :class:`LowbitExecutor` | the hooks of gpu/exec_torch.py's :class:`TorchExecutor` for ``weights="auto"`` on CPU: linears by size (float32 copies planned by ``gpu.model.gemm_plan`` for prefills, the int8 GEMVs for decode-sized calls, dense weights row by row), prefill attention per row (``attention_cpu.attend_rows``), decode attention per row, the one-call decode of every layer (``lowbit_cpu.decode_layers``) |

A row's bits never depend on the rows beside it: prefill GEMMs give each row the bits of a 32-row call on one
thread, attention runs each row over its own keys, and decode steps under ``decode_stacked_max_rows`` rows run
the batch-invariant GEMVs (docs/architecture.md, "Model weights and the prepared-model cache").
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .exec_torch import DecodeStep, TorchExecutor
from .quant import QuantLinear

__all__ = ["KERNEL_KV_DTYPES", "LowbitExecutor", "numba_view"]

KERNEL_KV_DTYPES = (torch.float32, torch.float16)   # the KV pools attention_cpu and decode_layers read


def numba_view(pool: torch.Tensor) -> np.ndarray:
    """``pool`` (float32 or float16, CPU) as the array numba takes: float32 as it is, float16 as its bits (uint16;
    numba has no CPU float16, gpu/attention_cpu.py widens them). No copy."""
    array = pool.numpy()
    return array.view(np.uint16) if array.dtype == np.float16 else array


class LowbitExecutor(TorchExecutor):
    """The native path (``LlamaModel.native``): float32 activations, packed weights with float32 copies."""

    name = "lowbit"

    def __init__(self, model: Any):
        super().__init__(model)
        if model.device.type != "cpu":
            raise ValueError("native low-bit weights run on CPU only; use float32 or bfloat16 on other devices")
        self.stacked: tuple | None = None  # the layers stacked for lowbit_cpu.decode_layers (stack_layers)

    def linear(self, lin: QuantLinear, x: torch.Tensor, big: bool) -> torch.Tensor:
        """``lin`` over ``x`` ``[N, K]`` -> ``[N, out]``: its float32 copy when ``big``, else its own kernel; a dense
        weight then runs row by row, so a decode row gets the bits it gets alone, as from the low-bit GEMVs
        (MKL's GEMM sums a row in another order in calls of 1 to 3 rows than in larger ones: `python -m
        bench.prefill_forward`)."""
        if big:  # the bits of a PREFILL_BLOCK_ROWS-row call (see there)
            return self.m._gemm_rows(lin, x)
        if lin.kind == "dense" and x.shape[0] > 1:
            return torch.cat([lin.fn(x[i:i + 1]) for i in range(x.shape[0])])
        return lin.fn(x)

    def prefill_head(self, x: torch.Tensor, big: bool) -> torch.Tensor:
        """The output projection follows the layers: float32 in every prefill by default (int8-rounded activations
        flip near ties, SmolLM2's "The capital..." vs "L'..." by 0.09 logits, when every layer runs low-bit too),
        with a row's bits whatever the rows beside it."""
        if self.m.prefill_head_dense:
            return self.m._gemm_rows(self.m.lm_head, x)
        return super().prefill_head(x, big)

    def attend_prefill(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                       v_pool: torch.Tensor, seqs: list[tuple], plan: Any) -> torch.Tensor:
        """Each token attends over its own keys (:meth:`attend_rows`): the same KV however the prompt is packed or
        cached."""
        return self.attend_rows(q, k_pool, v_pool, plan, self.m._windows[li])

    def attend_decode(self, li: int, q: torch.Tensor, kv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                      step: DecodeStep) -> torch.Tensor:
        """Low-bit rows are batch-invariant (lowbit_cpu's GEMVs); attention then runs per row over its own keys, as
        SDPA over keys padded to the longest row sums them in another order (0.4 logits apart after 30 layers)."""
        if step.big or step.B == 1:
            return super().attend_decode(li, q, kv, k_pool, v_pool, step)
        S = step.S
        return torch.cat([self.attend_row(q[b:b + 1], k_pool, v_pool, step.r_slot[b * S:b * S + p + 1],
                                          self.m._windows[li]) for b, p in enumerate(step.positions)])

    def decode(self, kv: torch.Tensor, token_ids: list[int], positions: list[int],
               block_tables: list[list[int]]) -> torch.Tensor:
        """``gpu.model.LlamaModel.decode``: through ``lowbit_cpu.decode_layers`` (every layer in one numba call)
        below ``decode_stacked_max_rows`` rows over a float32 or float16 pool where the layers are Llama's, else op
        by op."""
        m = self.m
        padded, w_blk = m._decode_tables(kv, token_ids, positions, block_tables)
        if len(token_ids) < m.decode_stacked_max_rows and kv.dtype in KERNEL_KV_DTYPES and (
                stacked := self.stack_layers()):
            return self.decode_stacked(kv, token_ids, positions, padded, stacked)
        return self.decode_layers(kv, token_ids, self.decode_step(kv, positions, padded, w_blk))

    def attention_plan(self, kv: torch.Tensor, seqs: list[tuple], w_slot: torch.Tensor, pos: torch.Tensor,
                    tables: list[list[int]]) -> tuple:
        """What :meth:`attend_rows` needs of a packed prefill: for ``attention_cpu.attend_rows`` (a float32 or float16
        pool, no soft-capping, a head dim it supports) the block tables int64 ``[B, blocks]`` (padded with their first
        block), each row's sequence and position int64 ``[N]`` and the pool's block size; else every sequence's
        context slots ``[S_b]`` for the per-token SDPA loop."""
        from . import attention_cpu  # noqa: PLC0415  (numba: only a native model's process imports it)

        if (kv.dtype in KERNEL_KV_DTYPES and self.m.dtype == torch.float32 and self.m.config.attn_softcap is None
                and attention_cpu.supported(kv.shape[-1])):
            width = max(len(t) for t in tables)
            padded = np.asarray([t + [t[0]] * (width - len(t)) for t in tables], np.int64)
            seq = np.repeat(np.arange(len(seqs), dtype=np.int64), [b - a for a, b, *_ in seqs])
            return "kernel", padded, seq, pos.numpy().astype(np.int64), kv.shape[3]
        return "sdpa", [w_slot[a:b] if r_slot is None else r_slot for a, b, r_slot, *_ in seqs], seqs, pos

    def attend_rows(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows_at: tuple,
                     window: int) -> torch.Tensor:
        """Causal attention of every packed row on its own, over its own sequence's keys in the pool (already
        written): a row's bits then depend on its query and keys only, not on the rows packed with it or on how
        many of its keys an earlier prefill wrote. q ``[N, H, D]``, the pools ``[slots, Hkv, D]``, ``rows_at``
        from :meth:`attention_plan`. Returns ``[N, H D]``."""
        N = q.shape[0]
        if rows_at[0] == "kernel":
            from . import attention_cpu  # noqa: PLC0415

            _, tables, seq, pos, block_tokens = rows_at
            out = np.empty(q.shape, np.float32)
            attention_cpu.attend_rows(q.contiguous().numpy(), numba_view(k_pool), numba_view(v_pool), tables,
                                      block_tokens, seq, pos, window, np.float32(self.m._scale), out)
            return torch.from_numpy(out).view(N, -1)
        _, seq_slots, seqs, pos = rows_at
        return torch.cat([self.attend_row(q[i:i + 1], k_pool, v_pool, slots[:p + 1], window)
                          for (a, b, *_), slots in zip(seqs, seq_slots)
                          for i, p in zip(range(a, b), pos[a:b].tolist())]).reshape(N, -1)

    def attend_row(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, r_slot: torch.Tensor,
                    window: int) -> torch.Tensor:
        """One decode row's attention over exactly its own keys (as a decode step of that row alone computes it):
        q ``[1, H, D]``, the pools ``[slots, Hkv, D]``, ``r_slot`` ``[S]`` the slots of its positions ``0 .. S - 1``
        (the last one its new token). Returns ``[1, H, 1, D]``."""
        c = self.m.config
        S = r_slot.shape[0]
        kc = k_pool.index_select(0, r_slot).to(self.m.dtype).view(1, S, c.num_kv_heads, c.head_dim).transpose(1, 2)
        vc = v_pool.index_select(0, r_slot).to(self.m.dtype).view(1, S, c.num_kv_heads, c.head_dim).transpose(1, 2)
        mask = None  # kc, vc: [1, Hkv, S, D]
        if window:
            mask = (torch.arange(S, device=self.m.device) > S - 1 - window)[None, None, None, :]  # [1, 1, 1, S]
        return self.m._attention(q.unsqueeze(2), kc, vc, mask)

    def stack_layers(self) -> tuple | None:
        """Every layer's norms stacked along a new first axis and every role's tiles as a tuple of the layers' own
        arrays (``lowbit_cpu.kernel_view``: no copy, each layer in its own form), for ``lowbit_cpu.decode_layers``;
        built once. None unless native with every layer linear in Q4, Q5 or Q8h tiles."""
        names, keys = ("qkv", "o", "gate_up", "down"), ("tiles", "tile_scale", "tile_min")
        if self.stacked is None:
            if not self.m.native or not self.m._llama_layers or any(
                    getattr(lay, n).kind not in ("int4", "int5", "int8h") for lay in self.m.layers for n in names):
                self.stacked = ()
                return None
            from .lowbit_cpu import kernel_view  # noqa: PLC0415

            stacks = {}
            for n in names:
                views = [kernel_view(lin.kind, *(lin.tensors[k] for k in keys))
                         for lin in (getattr(lay, n) for lay in self.m.layers)]
                stacks[n] = tuple(tuple(v[i] for v in views) for i in range(len(keys)))   # (tiles, scales, mins)
            norms = [torch.stack([getattr(lay, n) for lay in self.m.layers]).numpy() for n in ("ln_attn", "ln_mlp")]
            self.stacked = (*norms, *(stacks[n] for n in names))
        return self.stacked or None

    def decode_stacked(self, kv: torch.Tensor, token_ids: list[int], positions: list[int], padded: list[list[int]],
                        stacked: tuple) -> torch.Tensor:
        """``decode`` through ``lowbit_cpu.decode_layers`` (one numba call for all layers): logits ``[B, vocab]``."""
        from .lowbit_cpu import decode_layers, threads  # noqa: PLC0415
        c = self.m.config
        x = self.m._embed(torch.tensor(token_ids, dtype=torch.long))  # [B, hidden], fresh: updated in place
        decode_layers(x.numpy(), *stacked, numba_view(self.m._flat_pool(kv)), kv.shape[3], np.asarray(padded, np.int64),
                      np.asarray(positions, np.int64), self.m._cos.numpy(), self.m._sin.numpy(), c.num_heads,
                      c.intermediate_size, c.rms_norm_eps, self.m._scale, threads() > 1)
        x = F.rms_norm(x, (c.hidden_size,), self.m.norm, c.rms_norm_eps)
        big = len(token_ids) >= self.m.head_dense_min_rows
        return self.m._softcap_logits(self.m._linear(self.m.lm_head, x, big).float())

