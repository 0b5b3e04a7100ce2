"""The layer math every family shares, whatever path (gpu/exec_*.py) runs it.

| piece | what |
|---|---|
| :class:`Layer` | one decoder layer's weights: fused QKV, O, gate-up, down (``gpu.quant.QuantLinear``), norms, family extras, a sparse layer's router and experts |
| :func:`build_layers` | HF-named weights (gpu/loader.py) -> layers, embedding, LM head, final norm, RoPE frequencies |
| :func:`rope_inv_freq` | RoPE inverse frequencies with the config's scaling (linear, llama3, GGUF ``rope_freqs``) |
| :class:`LayerMath` | the model's shared body: embedding, RoPE tables and rotation, Q/K/V (bias, per-head norm), attention's formula (SDPA or soft-capped eager), the layer after attention (O, sandwich norms, MLP or MoE), final logit soft-cap |

The computation is Hugging Face's ``LlamaForCausalLM`` (``transformers/models/llama/modeling_llama.py``) with the
switches of :class:`gpu.families.Family`. :class:`LayerMath` is a base of ``gpu.model.LlamaModel``; every matmul it
does goes through ``self._linear(lin, x, big)``, which is the load-time executor's (``gpu/exec_torch.py``,
``gpu/exec_lowbit.py``, ``gpu/exec_cuda.py``): the path decides how a linear runs, never what the layer computes.
MLA (DeepSeek) replaces Q/K/V and attention with gpu/mla.py's and keeps the rest.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .loader import ModelConfig
from .quant import Int4Groups, Int5Groups, Int8Groups, Int8HalfGroups, QuantLinear, int8_groups_from_float

__all__ = ["Layer", "LayerMath", "build_layers", "fused_linear", "rope_inv_freq"]


def rope_inv_freq(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim // 2]`` float32, with the config's scaling applied.

    ``inv_freq[i] = rope_theta ** (-2i / head_dim)`` (Su et al., RoFormer). ``linear`` divides by ``factor``;
    ``llama3`` applies Llama 3.1's wavelength-dependent scaling (source: transformers
    ``modeling_rope_utils._compute_llama3_parameters``). ``freq_factors`` (a GGUF ``rope_freqs`` tensor)
    divide the frequencies as llama.cpp's ``ggml_rope_ext`` does.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = config.rope_scaling
    if rs is not None and rs.rope_type == "linear":
        inv_freq = inv_freq / rs.factor
    elif rs is not None and rs.rope_type == "llama3":
        old_len = rs.original_max_position_embeddings
        low_wavelen = old_len / rs.low_freq_factor
        high_wavelen = old_len / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.float().cpu()
    return inv_freq



@dataclass
class Layer:
    ln_attn: torch.Tensor  # [hidden]
    qkv: QuantLinear  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: QuantLinear  # [hidden, heads * head_dim]
    ln_mlp: torch.Tensor  # [hidden]: the MLP's pre-norm
    gate_up: QuantLinear | None  # [2 * intermediate, hidden]; None in a sparse (MoE) layer
    down: QuantLinear | None  # [hidden, intermediate]
    # family extras (gpu/families.py), None when the family has none; norm weights hold offset + w
    qkv_bias: torch.Tensor | None = None  # [(heads + 2 * kv_heads) * head_dim]
    q_norm: torch.Tensor | None = None  # [head_dim]
    k_norm: torch.Tensor | None = None  # [head_dim]
    post_attn: torch.Tensor | None = None  # [hidden]: norm of the attention output (sandwich norms)
    post_mlp: torch.Tensor | None = None  # [hidden]: norm of the MLP output
    router: torch.Tensor | None = None  # [experts, hidden]: a sparse layer's router (float32)
    experts: list[tuple[QuantLinear, QuantLinear]] | None = None  # per expert: gate_up [2 I, hidden], down

    EXTRAS = ("qkv_bias", "q_norm", "k_norm", "post_attn", "post_mlp")



def fused_linear(parts: list, native: bool, dtype: torch.dtype, device: torch.device) -> QuantLinear:
    """One linear over ``parts`` stacked along the output dim (fused QKV, gate-up). Natively: int4 when every part
    is Q4 groups, int5 when the parts are Q5 groups or Q4 and Q5, int8 when every part is int8 groups, int8h when
    the parts are half-scaled int8 groups or another mix (Q4_K_M's, e.g. Q5_0 Q/K with a Q8_0 V; each with its
    float32 copy for large batches); anything else is dequantized into a dense ``dtype`` weight."""
    if native and all(isinstance(p, Int4Groups) for p in parts):
        return QuantLinear.int4(Int4Groups.cat(parts))
    if native and all(isinstance(p, (Int4Groups, Int5Groups)) for p in parts):
        return QuantLinear.int5(Int5Groups.cat(parts))
    if native and all(isinstance(p, Int8Groups) for p in parts):
        return QuantLinear.int8(Int8Groups.cat(parts))
    if native and all(isinstance(p, (Int4Groups, Int5Groups, Int8Groups, Int8HalfGroups)) for p in parts):
        return QuantLinear.int8h(Int8HalfGroups.cat(parts))   # K-quants, Q5, mixes (converted exactly)
    dense = [p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts]
    return QuantLinear.dense(torch.cat([d.to(device=device, dtype=dtype) for d in dense]))



def build_layers(config: ModelConfig, weights: dict[str, Any], device: torch.device,
                 native: bool) -> tuple[torch.dtype, QuantLinear, QuantLinear, torch.Tensor, list[Layer], torch.Tensor]:
    """``(dtype, embedding, lm_head, norm, layers, inv_freq)`` of a GQA family's model from HF-named ``weights``
    (``gpu.model.LlamaModel``'s arguments): the activation dtype (float32 when ``native``, else the embedding's),
    the embedding ``[vocab, hidden]`` (int8 groups natively), the LM head (the embedding when tied), the final
    norm's scale ``[hidden]``, the layers and the RoPE frequencies ``[head_dim // 2]``."""
    embed = weights["model.embed_tokens.weight"]
    dtype = torch.float32 if native else embed.dtype
    dev = device

    def w(name: str) -> torch.Tensor:
        return weights[name].to(device=dev, dtype=dtype).contiguous()

    def lin(*names: str) -> QuantLinear:
        return fused_linear([weights[n] for n in names], native, dtype, dev)

    fam = config.spec

    def norm(name: str) -> torch.Tensor:  # the scale RMSNorm multiplies by: offset + w (Gemma: 1 + w)
        return (weights[name].to(device=dev, dtype=torch.float32) + fam.norm_offset).to(dtype).contiguous()

    layers = [_build_layer(config, weights, i, w, lin, norm) for i in range(config.num_layers)]
    if native:  # int8 groups (a tied output projection shares them) + the float32 table for lookups
        rows = embed if isinstance(embed, Int8Groups) else int8_groups_from_float(
            embed if isinstance(embed, torch.Tensor) else embed.dequantize())
        embedding = QuantLinear.int8(rows)
    else:
        embedding = QuantLinear.dense(w("model.embed_tokens.weight"))
    tied = config.tie_word_embeddings or "lm_head.weight" not in weights
    lm_head = embedding if tied else lin("lm_head.weight")
    if native and lm_head.kind == "dense":  # int8 groups as the embedding's (a dense one would run row by row)
        lm_head = QuantLinear.int8(int8_groups_from_float(lm_head.tensors["weight"]))
    inv_freq = rope_inv_freq(config, weights.get("rope_freqs"))
    return dtype, embedding, lm_head, norm("model.norm.weight"), layers, inv_freq


def _build_layer(config: ModelConfig, weights: dict[str, Any], i: int, w, lin, norm) -> Layer:
    """Layer ``i`` of :func:`build_layers` (``w``, ``lin``, ``norm``: its tensor, linear and norm makers)."""
    fam = config.spec
    p = f"model.layers.{i}."
    sparse = bool(config.moe_layers) and config.moe_layers[i]
    layer = Layer(
        ln_attn=norm(p + "input_layernorm.weight"),
        qkv=lin(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
        o=lin(p + "self_attn.o_proj.weight"),
        ln_mlp=norm(p + ("pre_feedforward_layernorm.weight" if fam.sandwich_norms
                         else "post_attention_layernorm.weight")),
        gate_up=None if sparse else lin(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
        down=None if sparse else lin(p + "mlp.down_proj.weight"),
    )
    if sparse:
        layer.router = weights[p + "mlp.gate.weight"].to(device=layer.ln_attn.device, dtype=torch.float32).contiguous()
        layer.experts = [(lin(p + f"mlp.experts.{e}.gate_proj.weight", p + f"mlp.experts.{e}.up_proj.weight"),
                          lin(p + f"mlp.experts.{e}.down_proj.weight")) for e in range(config.num_experts)]
    if fam.qkv_bias:
        layer.qkv_bias = torch.cat([w(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
    if fam.qk_norm:
        layer.q_norm, layer.k_norm = norm(p + "self_attn.q_norm.weight"), norm(p + "self_attn.k_norm.weight")
    if fam.sandwich_norms:
        layer.post_attn = norm(p + "post_attention_layernorm.weight")
        layer.post_mlp = norm(p + "post_feedforward_layernorm.weight")
    return layer


class LayerMath:
    """The shared layer body, a base of ``gpu.model.LlamaModel``: reads ``config``, ``device``, ``dtype``,
    ``embedding``, the RoPE state :meth:`_init_rope` sets, ``_scale``, ``_embed_scale``, ``_silu``,
    ``_local_rope``, ``dense_min_tokens`` and ``executor`` (whose ``linear`` runs every matmul)."""

    def _linear(self, lin: QuantLinear, x: torch.Tensor, big: bool) -> torch.Tensor:
        """``lin`` over ``x`` ``[N, K]`` -> ``[N, out]`` as the model's executor runs it (``big``: a prefill-sized
        call, see ``gpu.exec_lowbit``)."""
        return self.executor.linear(lin, x, big)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]`` in the activation dtype for ``ids`` ``[T]``."""
        t = self.embedding.tensors
        if "dense" in t or "weight" in t:  # a gather touches only these rows, even of a memory-mapped table
            x = F.embedding(ids, t.get("dense", t.get("weight")))
        else:
            from .lowbit_cpu import q8_rows  # noqa: PLC0415
            x = q8_rows(ids, t["tiles"], t["tile_scale"]).to(self.dtype)
        return x if self._embed_scale is None else x * self._embed_scale  # Gemma: times sqrt(hidden)

    def _init_rope(self, inv_freq: torch.Tensor) -> None:
        """RoPE state: the global frequencies, Gemma 3's sliding layers' local ones, tables for 4096 positions."""
        config = self.config
        self._inv_freq = inv_freq  # [head_dim // 2] float32, cpu
        # sliding layers with their own RoPE base (Gemma 3) read the local tables, unscaled
        self._windows = list(config.layer_windows) or [0] * config.num_layers  # per layer, 0 = global
        self._local_rope = [config.local_rope_theta is not None and wnd > 0 for wnd in self._windows]
        self._inv_freq_local = None if config.local_rope_theta is None else rope_inv_freq(
            dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None))
        self._rope_len = 0
        self._cos = self._sin = self._cos_local = self._sin_local = torch.empty(0)
        self._ensure_rope(min(config.max_position_embeddings, 4096))

    def _ensure_rope(self, n: int) -> None:
        """Make the cos/sin tables cover positions ``[0, n)``; grows by doubling."""
        if n <= self._rope_len:
            return
        n = max(n, 2 * self._rope_len)
        self._cos, self._sin = self._rope_tables(self._inv_freq, n)
        if self._inv_freq_local is not None:
            self._cos_local, self._sin_local = self._rope_tables(self._inv_freq_local, n)
        self._rope_len = n

    def _rope_tables(self, inv_freq: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``[n, head_dim]`` for positions ``[0, n)``."""
        t = torch.arange(n, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [n, head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [n, head_dim]
        half = self.config.head_dim // 2
        sin = emb.sin()
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: fold rotate_half's sign into the table.
        sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        return (emb.cos().to(device=self.device, dtype=self.dtype),  # [n, head_dim]
                sin_signed.to(device=self.device, dtype=self.dtype))  # [n, head_dim]

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [tokens, heads, head_dim]; cos, sin: [tokens, 1, head_dim]
        return x * cos + torch.roll(x, self.config.head_dim // 2, dims=-1) * sin

    def _rope_at(self, pos: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin ``[N, 1, D]`` at positions ``pos`` ``[N]``: key True = the local tables (Gemma 3's sliding
        layers), False = the global ones."""
        out = {False: (self._cos[pos].unsqueeze(1), self._sin[pos].unsqueeze(1))}
        if self._inv_freq_local is not None:
            out[True] = (self._cos_local[pos].unsqueeze(1), self._sin_local[pos].unsqueeze(1))
        return out

    def _qkv(self, li: int, layer: Layer, h: torch.Tensor, rope: dict, big: bool) -> tuple[torch.Tensor, ...]:
        """Q ``[N, H, D]``, K ``[N, Hkv, D]`` (biased, per-head normed, rotated) and V ``[N, Hkv, D]`` of layer
        ``li`` from its normed input ``h`` ``[N, hidden]``."""
        c = self.config
        N, H, Hkv, D = h.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        qkv = self._linear(layer.qkv, h, big)  # qkv: [N, (H + 2 Hkv) D]
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        qk = qkv[:, :(H + Hkv) * D].view(N, H + Hkv, D)
        if layer.q_norm is not None:
            qk = torch.cat([F.rms_norm(qk[:, :H], (D,), layer.q_norm, c.rms_norm_eps),
                            F.rms_norm(qk[:, H:], (D,), layer.k_norm, c.rms_norm_eps)], dim=1)
        cos, sin = rope[self._local_rope[li]]
        qk = self._rope(qk, cos, sin)  # qk: [N, H + Hkv, D]
        return qk[:, :H], qk[:, H:], qkv[:, (H + Hkv) * D:].view(N, Hkv, D)

    def _layer_rest(self, layer: Layer, x: torch.Tensor, o: torch.Tensor, big: bool) -> torch.Tensor:
        """The layer after attention: ``x`` ``[N, hidden]`` (updated in place) plus the output projection of
        ``o`` ``[N, H D]`` (post-normed with sandwich norms), then plus the gated MLP of its pre-normed sum."""
        c = self.config
        hidden, eps = (c.hidden_size,), c.rms_norm_eps
        a = self._linear(layer.o, o, big)
        if layer.post_attn is not None:
            a = F.rms_norm(a, hidden, layer.post_attn, eps)
        x.add_(a)
        h = F.rms_norm(x, hidden, layer.ln_mlp, eps)
        m = self._mlp(layer.gate_up, layer.down, h, big) if layer.router is None else self._moe(layer, h, big)
        if layer.post_mlp is not None:
            m = F.rms_norm(m, hidden, layer.post_mlp, eps)
        return x.add_(m)

    def _mlp(self, gate_up: QuantLinear, down: QuantLinear, h: torch.Tensor, big: bool) -> torch.Tensor:
        """The gated MLP ``down(act(gate(h)) * up(h))``: ``h`` ``[N, hidden]`` -> ``[N, hidden]``."""
        gate, up = self._linear(gate_up, h, big).chunk(2, dim=-1)  # [N, I] each
        act = F.silu(gate) if self._silu else F.gelu(gate, approximate="tanh")
        return self._linear(down, act * up, big)

    def _moe(self, layer: Layer, h: torch.Tensor, big: bool) -> torch.Tensor:
        """A sparse layer's MLP (Qwen3-MoE, as HF's ``Qwen3MoeSparseMoeBlock``): softmax over the router's
        logits, the top ``experts_per_token`` per token (renormalised when ``norm_topk_prob``); each chosen expert
        runs once over its own tokens only and adds its weighted output. ``h`` ``[N, hidden]`` -> ``[N, hidden]``."""
        c = self.config
        probs = torch.softmax(self._linear(QuantLinear.dense(layer.router), h.float(), big), dim=-1)  # [N, E]
        weight, chosen = torch.topk(probs, c.experts_per_token, dim=-1)  # [N, k] each
        if c.norm_topk_prob:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        weight = weight.to(h.dtype)
        out = torch.zeros_like(h)
        for e in chosen.unique().tolist():  # ascending, as HF adds them
            rows, slot = (chosen == e).nonzero(as_tuple=True)  # the tokens routed to e, and where in their top-k
            gate_up, down = layer.experts[e]
            y = self._mlp(gate_up, down, h[rows], big and len(rows) >= self.dense_min_tokens)
            out.index_add_(0, rows, y * weight[rows, slot, None])
        return out

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   causal: bool = False) -> torch.Tensor:
        """Grouped-query attention: q ``[B, H, T, D]``, k/v ``[B, Hkv, S, D]``, ``mask`` bool broadcasting to
        ``[B, H, T, S]`` (True = attend) or None: every key, or with ``causal`` (``S == T``) the causal ones.
        Scores are ``q.k * attn_scale``, soft-capped as ``cap * tanh(s / cap)`` when the config has
        ``attn_softcap`` (as HF's eager attention). Returns ``[B, H, T, D]``."""
        cap = self.config.attn_softcap
        if cap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                                  scale=self._scale, enable_gqa=True)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [B, H, S, D]
        s = torch.matmul(q, k.transpose(-1, -2)) * self._scale  # s: [B, H, T, S]
        s = torch.tanh(s / cap) * cap
        if mask is None and causal:
            T, S = s.shape[-2:]
            mask = torch.ones(T, S, dtype=torch.bool, device=s.device).tril(S - T)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)

    def _softcap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``cap * tanh(logits / cap)`` when the config has ``final_softcap`` (Gemma 2), else ``logits``."""
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
