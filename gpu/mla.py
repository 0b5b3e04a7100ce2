"""Multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024) over the paged KV pool, with DeepSeek's MoE (V2 and V3).

The computation of Hugging Face's ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` (``transformers/models/
deepseek_v2``, ``deepseek_v3``). Per layer and token::

    q          = q_proj(h)                      [H, nope + rope]   (its rope part rotated)
               or q_b_proj(rms(q_a_proj(h)))                       (q_lora_rank > 0: V2 full size, V3)
    c, k_rope  = kv_a_proj_with_mqa(h)          [rank], [rope]     (c RMS-normed, k_rope rotated)
    k_nope, v  = kv_b_proj(c)                   [H, nope], [H, v]  (decompressed from the cache at every step)
    k          = k_nope ++ k_rope (shared by the heads)

RoPE pairs adjacent elements (``x[2i], x[2i+1]``), as HF's complex ``apply_rotary_emb`` (V2) and
``apply_rotary_pos_emb_interleave`` (V3), or the two halves when a V3 config turns ``rope_interleave`` off, with
YaRN scaling when the config has it. The cache holds only
``row = c ++ k_rope`` per token and layer: ``rank + rope`` values, stored in the pool of gpu/model.py with
``num_kv_heads`` 1 and ``head_dim = (rank + rope) / 2`` (an odd sum is refused at load), the row's first half in
the K plane, the second in the V plane::

    kv[layer, 0, block, offset, 0, :] = row[:head_dim]        kv[layer, 1, block, offset, 0, :] = row[head_dim:]

so a token costs ``layers * (rank + rope) * dtype bytes`` and the pool, the handoff and the prefix cache move
latent blocks without knowing it. Attention decompresses the context's rows per step (naive; the
absorbed-weight form is a later optimisation). Layers from ``first_k_dense_replace`` on replace the MLP by
routed experts (``ModelConfig.moe_gating``: V2's softmax or V3's bias-corrected sigmoid, top-k within the best
``topk_group`` of ``n_group`` groups, times ``routed_scaling_factor``) plus ``n_shared_experts`` shared experts run
on every token. Low-bit GGUF weights are not kept packed here: the family always runs dense (float32 or bfloat16).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .exec_torch import DecodeStep, TorchExecutor
from .layers import fused_linear as _linear
from .loader import ModelConfig
from .model import LlamaModel
from .quant import QuantLinear

__all__ = ["MLAModel", "MLATorchExecutor"]


@dataclass
class _MLALayer:
    ln_attn: torch.Tensor  # [hidden]
    q: QuantLinear | None  # [H * (nope + rope), hidden]; None with a compressed query (q_a, q_a_norm, q_b)
    kv_a: QuantLinear  # [rank + rope, hidden]
    kv_a_norm: torch.Tensor  # [rank]
    kv_b: QuantLinear  # [H * (nope + v), rank]
    o: QuantLinear  # [hidden, H * v]
    ln_mlp: torch.Tensor  # [hidden]
    gate_up: QuantLinear | None  # [2 * intermediate, hidden]; None in a sparse layer
    down: QuantLinear | None  # [hidden, intermediate]
    q_a: QuantLinear | None = None  # [q_lora_rank, hidden]
    q_a_norm: torch.Tensor | None = None  # [q_lora_rank]
    q_b: QuantLinear | None = None  # [H * (nope + rope), q_lora_rank]
    router: torch.Tensor | None = None  # [experts, hidden] float32
    router_bias: torch.Tensor | None = None  # [experts] float32: V3's e_score_correction_bias
    experts: list[tuple[QuantLinear, QuantLinear]] | None = None  # per expert: gate_up, down
    shared: tuple[QuantLinear, QuantLinear] | None = None  # the shared experts as one gated MLP
    post_attn: None = None  # gpu/model.py's _layer_rest reads these (no sandwich norms here)
    post_mlp: None = None

    LINEARS = ("q", "kv_a", "kv_b", "o", "gate_up", "down", "q_a", "q_b")  # the optional ones may be None
    TENSORS = ("ln_attn", "kv_a_norm", "ln_mlp", "q_a_norm", "router", "router_bias")  # norms, router: plain tensors


class MLAModel(LlamaModel):
    """A DeepSeek-V2 decoder (``Family.attention == "mla"``) with :class:`gpu.model.LlamaModel`'s interface:
    ``prefill``, ``prefill_packed``, ``decode`` over the pool ``kv_pool_shape(config, ...)`` gives (layout in the
    module docstring), ``to_state`` / ``from_state``. ``native`` is accepted and ignored (weights run dense).
    Paths: ``"torch"`` (:class:`MLATorchExecutor`) or ``"cuda"`` (gpu/exec_cuda.py)."""

    def __init__(self, config: ModelConfig, weights: dict[str, Any], device: str | torch.device = "cpu",
                 native: bool = False, executor: str = "auto", executor_options: dict[str, Any] | None = None):
        # packed GGUF weights (``native``) run dequantized: this family has no low-bit path
        weights = {k: v if isinstance(v, torch.Tensor) else v.dequantize() for k, v in weights.items()}
        embed = weights["model.embed_tokens.weight"]
        dtype = torch.float32 if native else embed.dtype
        dev = torch.device(device)

        def lin(*names: str) -> QuantLinear:
            return _linear([weights[n] for n in names], False, dtype, dev)

        def vec(name: str) -> torch.Tensor:
            return weights[name].to(device=dev, dtype=dtype).contiguous()

        def opt(name: str, make) -> Any:
            return make(name) if name in weights else None

        layers = []
        for i in range(config.num_layers):
            p, m = f"model.layers.{i}.", f"model.layers.{i}.mlp."
            a = p + "self_attn."
            sparse = bool(config.moe_layers) and config.moe_layers[i]
            layer = _MLALayer(
                ln_attn=vec(p + "input_layernorm.weight"), q=opt(a + "q_proj.weight", lin),
                q_a=opt(a + "q_a_proj.weight", lin), q_a_norm=opt(a + "q_a_layernorm.weight", vec),
                q_b=opt(a + "q_b_proj.weight", lin), kv_a=lin(a + "kv_a_proj_with_mqa.weight"),
                kv_a_norm=vec(a + "kv_a_layernorm.weight"), kv_b=lin(a + "kv_b_proj.weight"),
                o=lin(a + "o_proj.weight"), ln_mlp=vec(p + "post_attention_layernorm.weight"),
                gate_up=None if sparse else lin(m + "gate_proj.weight", m + "up_proj.weight"),
                down=None if sparse else lin(m + "down_proj.weight"))
            if sparse:
                layer.router = weights[m + "gate.weight"].to(device=dev, dtype=torch.float32).contiguous()
                if config.moe_gating == "sigmoid":
                    layer.router_bias = weights[m + "gate.e_score_correction_bias"].to(
                        device=dev, dtype=torch.float32).contiguous()
                layer.experts = [(lin(m + f"experts.{e}.gate_proj.weight", m + f"experts.{e}.up_proj.weight"),
                                  lin(m + f"experts.{e}.down_proj.weight")) for e in range(config.num_experts)]
                if config.n_shared_experts:
                    layer.shared = (lin(m + "shared_experts.gate_proj.weight", m + "shared_experts.up_proj.weight"),
                                    lin(m + "shared_experts.down_proj.weight"))
            layers.append(layer)
        embedding = QuantLinear.dense(vec("model.embed_tokens.weight"))
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        lm_head = embedding if tied else lin("lm_head.weight")
        self._setup(config, dev, dtype, False, embedding, lm_head, vec("model.norm.weight"), layers,
                    _rope_inv_freq(config), executor, executor_options)

    def _torch_executor(self) -> "MLATorchExecutor":
        return MLATorchExecutor(self)

    # -- RoPE: interleaved pairs over the qk_rope_head_dim part --------------------------------------------

    def _rope_tables(self, inv_freq: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[n, rope // 2]`` for positions ``[0, n)``."""
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)  # [n, rope // 2]
        scale = _yarn_attention_factor(self.config)
        return (freqs.cos() * scale).to(self.device, self.dtype), (freqs.sin() * scale).to(self.device, self.dtype)

    def _rope_pairs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, heads, rope]`` rotated; cos, sin ``[N, 1, rope // 2]``. Pairs ``(x[2i], x[2i+1])``, kept
        in place, or (``rope_interleaved`` False) ``(x[i], x[i + rope // 2])``, as HF's ``rotate_half``."""
        if not self.config.rope_interleaved:
            x0, x1 = x.chunk(2, dim=-1)
            return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)

    # -- one layer's attention parts -----------------------------------------------------------------------

    def _q_row(self, layer: _MLALayer, h: torch.Tensor, rope: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Q ``[N, H, nope + rope]`` (rope part rotated) and the cache row ``[N, 2 * head_dim]`` (normed latent,
        rotated key) of the normed input ``h`` ``[N, hidden]``."""
        c = self.config
        N, H, nope, rp, rank = h.shape[0], c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        cos, sin = rope[False]
        if layer.q is None:  # the compressed query
            q_a = self._linear(layer.q_a, h, False)  # [N, q_lora_rank]
            q = self._linear(layer.q_b, F.rms_norm(q_a, (c.q_lora_rank,), layer.q_a_norm, c.rms_norm_eps), False)
        else:
            q = self._linear(layer.q, h, False)
        q = q.view(N, H, nope + rp)
        q = torch.cat([q[..., :nope], self._rope_pairs(q[..., nope:], cos, sin)], dim=-1)
        a = self._linear(layer.kv_a, h, False)  # [N, rank + rope]
        latent = F.rms_norm(a[:, :rank], (rank,), layer.kv_a_norm, c.rms_norm_eps)
        k_rope = self._rope_pairs(a[:, None, rank:], cos, sin)[:, 0]  # [N, rope]
        return q, torch.cat([latent, k_rope], dim=-1)

    def _expand(self, layer: _MLALayer, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K ``[..., H, nope + rope]`` and V ``[..., H, v]`` decompressed from cache rows ``[..., 2 * head_dim]``."""
        c = self.config
        H, nope, rp, rank = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        kv = self._linear(layer.kv_b, rows[..., :rank].reshape(-1, rank), False).view(
            *rows.shape[:-1], H, nope + c.v_head_dim)  # [..., H, nope + v]
        k_rope = rows[..., None, rank:rank + rp].expand(*kv.shape[:-1], rp)
        return torch.cat([kv[..., :nope], k_rope], dim=-1), kv[..., nope:]

    @staticmethod
    def _write(kv_flat: torch.Tensor, li: int, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Store ``rows`` ``[N, 2 * head_dim]`` at pool ``slots`` ``[N]`` of layer ``li``; returns them as the pool
        holds them (rounded through its dtype)."""
        d = kv_flat.shape[-1]
        stored = rows.to(kv_flat.dtype)
        kv_flat[li, 0].index_copy_(0, slots, stored[:, None, :d])
        kv_flat[li, 1].index_copy_(0, slots, stored[:, None, d:])
        return stored

    @staticmethod
    def _read(kv_flat: torch.Tensor, li: int, slots: torch.Tensor) -> torch.Tensor:
        """The cache rows ``[len(slots), 2 * head_dim]`` of layer ``li``."""
        return torch.cat([kv_flat[li, 0].index_select(0, slots)[:, 0], kv_flat[li, 1].index_select(0, slots)[:, 0]],
                         dim=-1)

    def _moe(self, layer: _MLALayer, h: torch.Tensor, big: bool) -> torch.Tensor:
        """DeepSeek's MoE (HF ``DeepseekV2Moe`` / ``DeepseekV3MoE``): each token's top ``experts_per_token`` experts
        among the ``topk_group`` best of ``n_group`` groups, each run on its own tokens, weighted, plus the shared
        experts. Softmax gating (V2): experts and groups (a group's best expert) ranked by probability, weights the
        probabilities. Sigmoid gating (V3, ``noaux_tc``): ranked by sigmoid score plus ``router_bias``, a group by
        its best two, weights the unbiased scores (renormalised when ``norm_topk_prob``). Weights times
        ``routed_scaling_factor``. ``h`` ``[N, hidden]`` -> ``[N, hidden]``."""
        c = self.config
        logits = F.linear(h.float(), layer.router)  # [N, E]
        if c.moe_gating == "sigmoid":
            scores = logits.sigmoid()
            choice = scores + layer.router_bias
        else:
            scores = choice = torch.softmax(logits, dim=-1)
        if c.n_group > 1:
            groups = choice.view(-1, c.n_group, c.num_experts // c.n_group)  # [N, G, E / G]
            rank = groups.amax(dim=-1) if c.moe_gating == "softmax" else groups.topk(2, dim=-1).values.sum(dim=-1)
            best = torch.topk(rank, c.topk_group, dim=-1).indices  # [N, topk_group]
            keep = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, best, True)  # [N, G]
            # softmax: out-of-group probabilities 0 (HF's masked_fill), sigmoid: -inf (scores + bias may be < 0)
            choice = groups.masked_fill(~keep[..., None], 0.0 if c.moe_gating == "softmax" else float("-inf"))
            choice = choice.view_as(scores)
        chosen = torch.topk(choice, c.experts_per_token, dim=-1).indices  # [N, k]
        weight = scores.gather(1, chosen)  # [N, k]
        if c.norm_topk_prob:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        weight = (weight * c.routed_scaling_factor).to(h.dtype)
        out = torch.zeros_like(h)
        for e in chosen.unique().tolist():  # ascending, as HF adds them
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            gate_up, down = layer.experts[e]
            out.index_add_(0, rows, self._mlp(gate_up, down, h[rows], False) * weight[rows, slot, None])
        if layer.shared is not None:
            out = out + self._mlp(*layer.shared, h, False)
        return out

    # -- sizes and the prepared state ----------------------------------------------------------------------

    def weight_bytes(self) -> int:
        """Bytes of weights a decode step could read (every linear, every expert, the norms)."""
        lins = [getattr(lay, n) for lay in self.layers for n in _MLALayer.LINEARS if getattr(lay, n) is not None]
        lins += [lin for lay in self.layers for pair in (lay.experts or []) + [lay.shared or ()] for lin in pair]
        norms = [getattr(lay, n) for lay in self.layers for n in _MLALayer.TENSORS if getattr(lay, n) is not None]
        return sum(lin.weight_bytes for lin in lins + [self.lm_head]) + sum(t.numel() * t.element_size()
                                                                           for t in norms + [self.norm])


class MLATorchExecutor(TorchExecutor):
    """The dense torch path of an :class:`MLAModel` (any torch device): attention decompresses the context's cache
    rows through ``kv_b_proj`` and runs SDPA; ``attend_decode_mla`` is the hook gpu/exec_cuda.py overrides."""

    def prefill_packed(self, kv: torch.Tensor, token_ids: list[list[int]], block_tables: list[list[int]],
                       start_positions: list[int], all_logits: list[bool] | None,
                       logits: list[bool] | None, hidden: list[bool] | None = None) -> list[torch.Tensor | None]:
        """As :meth:`gpu.model.LlamaModel.prefill_packed` (same arguments, returns and errors)."""
        m = self.m
        c = m.config
        flags, seqs, w_slot, pos, _ = m._packed_start(kv, token_ids, block_tables, start_positions, all_logits)
        kv_flat = m._flat_pool(kv)  # [L, 2, slots, 1, head_dim]
        rope = m._rope_at(pos)
        x = m._embed(torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long, device=m.device))
        norm_shape, eps = (c.hidden_size,), c.rms_norm_eps
        for li, layer in enumerate(m.layers):
            h = F.rms_norm(x, norm_shape, layer.ln_attn, eps)  # [N, hidden]
            q, row = m._q_row(layer, h, rope)  # [N, H, nope + rope], [N, 2 head_dim]
            stored = m._write(kv_flat, li, w_slot, row)
            outs = []
            for a, b, r_slot, mask, _ in seqs:
                rows = stored[a:b] if r_slot is None else m._read(kv_flat, li, r_slot)  # [S, 2 head_dim]
                k, v = m._expand(layer, rows.to(m.dtype))  # [S, H, nope + rope], [S, H, v]
                o = F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                    attn_mask=mask, is_causal=r_slot is None, scale=m._scale)  # [1, H, T, v]
                outs.append(o[0].transpose(0, 1).reshape(b - a, -1))  # [T, H v]
            x = m._layer_rest(layer, x, outs[0] if len(outs) == 1 else torch.cat(outs), False)
        return self.packed_logits(x, seqs, flags, False, logits, hidden)

    def decode_layers(self, kv: torch.Tensor, token_ids: list[int], step: DecodeStep) -> torch.Tensor:
        """As :meth:`gpu.model.LlamaModel.decode` after the checks: logits ``[B, vocab]``."""
        m = self.m
        c = m.config
        kv_flat = m._flat_pool(kv)  # [L, 2, slots, 1, head_dim]
        rope = m._rope_at(step.pos_t)
        x = m._embed(torch.tensor(token_ids, dtype=torch.long, device=m.device))  # [B, hidden]
        hidden, eps = (c.hidden_size,), c.rms_norm_eps
        for li, layer in enumerate(m.layers):
            h = F.rms_norm(x, hidden, layer.ln_attn, eps)
            q, row = m._q_row(layer, h, rope)  # [B, H, nope + rope], [B, 2 head_dim]
            m._write(kv_flat, li, step.w_slot, row)
            o = self.attend_decode_mla(li, layer, q, kv, kv_flat, step)  # [B, H, 1, v]
            x = m._layer_rest(layer, x, o.reshape(step.B, -1), False)
        return m._linear(m.lm_head, F.rms_norm(x, hidden, m.norm, eps), False).float()  # [B, vocab]

    def attend_decode_mla(self, li: int, layer: _MLALayer, q: torch.Tensor, kv: torch.Tensor,
                          kv_flat: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """Decode attention of layer ``li``: q ``[B, H, nope + rope]`` over each row's cache rows (the new ones
        already written; ``kv`` the pool, ``kv_flat`` its slot view), decompressed per head. Returns
        ``[B, H, 1, v]``."""
        m = self.m
        k, v = m._expand(layer, m._read(kv_flat, li, step.r_slot).to(m.dtype).view(step.B, step.S, -1))
        # k: [B, S, H, nope + rope]; v: [B, S, H, v]
        return F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=step.masks[0], scale=m._scale)  # [B, H, 1, v]


def _rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """``[qk_rope_head_dim // 2]`` float32: ``rope_theta ** (-2i / qk_rope_head_dim)``, with YaRN's blend when the
    config has it (``gpu.loader.RopeScaling``; source: transformers ``_compute_yarn_parameters``)."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    extrapolated = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = config.rope_scaling
    if rs is None or rs.rope_type != "yarn":
        return extrapolated

    def dim_of(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times in the old context
        return dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(dim_of(rs.beta_fast)), 0), min(math.ceil(dim_of(rs.beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (fast dims), 0: interpolated by factor (slow dims)
    return extrapolated / rs.factor * (1 - keep) + extrapolated * keep


def _yarn_attention_factor(config: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by: ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both
    are set, else ``mscale(factor)``; 1 without YaRN."""
    from .loader import _yarn_mscale  # noqa: PLC0415

    rs = config.rope_scaling
    if rs is None or rs.rope_type != "yarn":
        return 1.0
    if rs.mscale and rs.mscale_all_dim:
        return _yarn_mscale(rs.factor, rs.mscale) / _yarn_mscale(rs.factor, rs.mscale_all_dim)
    return _yarn_mscale(rs.factor)

