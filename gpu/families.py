"""Model families: what distinguishes each decoder architecture pdserve runs, as data read by the one model.

==================  ==============================  ============  ==========================================
family              HF ``model_type``               GGUF arch     differences from Llama
==================  ==============================  ============  ==========================================
llama               llama                           llama         (the reference)
mistral             mistral                         llama         sliding window on every layer (config)
qwen2               qwen2                           qwen2         Q/K/V bias; sliding layers (config)
qwen3               qwen3                           qwen3         per-head Q/K RMSNorm; sliding layers
phi3                phi3                            phi3          fused qkv_proj / gate_up_proj (split on load)
gemma2              gemma2                          gemma2        see :data:`GEMMA2`
gemma3              gemma3_text                     gemma3        Gemma 2 without soft-capping, with Q/K norm
qwen3_moe           qwen3_moe                       qwen3moe      Qwen3 with top-k routed experts as MLP
deepseek2           deepseek_v2                     deepseek2     MLA attention, see :data:`DEEPSEEK2`
deepseek3           deepseek_v3                     deepseek2     DeepSeek-V2's layers, sigmoid routing (config)
==================  ==============================  ============  ==========================================

A family's static traits are a :class:`Family`; what varies per checkpoint (window sizes, which layers slide,
soft-capping values, the attention scale, the local RoPE base) is in ``gpu.loader.ModelConfig``. Every family
here keeps the Llama KV pool layout ``[layers, 2, blocks, block_tokens, kv_heads, head_dim]``; a sliding
window only masks keys (the blocks behind the window stay allocated). MLA families (``attention="mla"``) cache
one latent row per token and layer in the same layout (see gpu/mla.py), so the pool, the handoff and the prefix
cache carry them unchanged. Adding a family: a :class:`Family`
entry in :data:`FAMILIES` (and, when its config or GGUF keys say something new, a few lines in gpu/loader.py).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "Family", "family", "family_for_gguf_arch", "family_for_hf", "supported_names"]


@dataclass(frozen=True)
class Family:
    """Static traits of one architecture.

    ``norm_offset``: RMSNorm scales by ``offset + weight`` (Gemma stores ``w`` and scales by ``1 + w``; llama.cpp's
    converter writes ``1 + w`` into the GGUF, which the loader undoes). ``activation``: the MLP's gate function
    (``silu``: SwiGLU, ``gelu_tanh``: GeGLU). ``qkv_bias``: Q/K/V projections carry biases. ``qk_norm``: RMSNorm
    over each head's Q and K before RoPE. ``sandwich_norms``: norms after the attention and MLP outputs as well
    (Gemma 2/3: ``post_attention_layernorm`` is then a post-norm and ``pre_feedforward_layernorm`` the MLP's
    pre-norm). ``embed_scale``: embeddings are multiplied by ``sqrt(hidden_size)``. ``fused``: HF checkpoints
    hold fused ``qkv_proj`` / ``gate_up_proj``. ``gguf_permuted_qk``: llama.cpp's converter permuted Q/K rows.
    ``moe``: sparse layers replace the MLP by a router (softmax over experts, top ``experts_per_token``) and
    experts, each a gated MLP run on its tokens only (config: ``num_experts``, ``moe_layers``...).
    ``attention``: ``"gqa"`` (grouped-query attention over per-head K/V, gpu/model.py) or ``"mla"`` (multi-head
    latent attention, DeepSeek-V2/V3: the KV cache holds the compressed latent and the rotary key part; gpu/mla.py).
    """

    name: str
    hf_model_types: tuple[str, ...]
    gguf_arch: str
    norm_offset: float = 0.0
    activation: str = "silu"
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    fused: bool = False
    gguf_permuted_qk: bool = False
    moe: bool = False
    attention: str = "gqa"

    @property
    def llama_like(self) -> bool:
        """True when a layer is exactly Llama's (the one-call low-bit decode kernel can run it)."""
        return (self.norm_offset == 0.0 and self.activation == "silu" and not self.qkv_bias and not self.qk_norm
                and not self.sandwich_norms and not self.embed_scale and not self.moe
                and self.attention == "gqa")


LLAMA = Family("llama", ("llama",), "llama", gguf_permuted_qk=True)
MISTRAL = Family("mistral", ("mistral",), "llama", gguf_permuted_qk=True)
QWEN2 = Family("qwen2", ("qwen2",), "qwen2", qkv_bias=True)
QWEN3 = Family("qwen3", ("qwen3",), "qwen3", qk_norm=True)
PHI3 = Family("phi3", ("phi3",), "phi3", fused=True)
# Gemma 2: (1 + w) RMSNorm, GeGLU (gelu tanh), pre and post norms around attention and MLP, scaled embeddings,
# attention / final logit soft-capping and query_pre_attn_scalar (config), alternating sliding/global layers
GEMMA2 = Family("gemma2", ("gemma2",), "gemma2", norm_offset=1.0, activation="gelu_tanh", sandwich_norms=True,
                embed_scale=True)
GEMMA3 = Family("gemma3", ("gemma3_text",), "gemma3", norm_offset=1.0, activation="gelu_tanh", qk_norm=True,
                sandwich_norms=True, embed_scale=True)

QWEN3_MOE = Family("qwen3_moe", ("qwen3_moe",), "qwen3moe", qk_norm=True, moe=True)
# DeepSeek-V2 (V2-Lite shape): multi-head latent attention (Q from one projection, K/V decompressed from a cached
# kv_lora_rank latent, a decoupled RoPE part shared by the heads, interleaved-pair RoPE), MoE after the first
# first_k_dense_replace layers with shared experts and group-limited top-k routing (gpu/mla.py)
DEEPSEEK2 = Family("deepseek2", ("deepseek_v2",), "deepseek2", moe=True, attention="mla")
# DeepSeek-V3 / R1: V2's layers (with the compressed query, q_lora_rank); what differs is the router, read from the
# config into ModelConfig.moe_gating (sigmoid scores with a correction bias, noaux_tc groups). llama.cpp writes V3
# as a deepseek2 GGUF (expert_gating_func sigmoid), which loads under DEEPSEEK2 with the same config values.
DEEPSEEK3 = Family("deepseek3", ("deepseek_v3",), "deepseek2", moe=True, attention="mla")

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA2, GEMMA3, QWEN3_MOE,
                                                   DEEPSEEK2, DEEPSEEK3)}


def family(name: str) -> Family:
    """The family called ``name`` (``ModelConfig.family``). Raises KeyError naming the supported ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown model family {name!r}; supported: {supported_names()}") from None


def family_for_hf(model_type: str | None, architectures: list[str] | None = None) -> Family | None:
    """The family of a HF ``config.json`` (its ``model_type``; ``LlamaForCausalLM`` in ``architectures`` also
    means Llama), or None."""
    for f in FAMILIES.values():
        if model_type in f.hf_model_types:
            return f
    return LLAMA if "LlamaForCausalLM" in (architectures or []) else None


def family_for_gguf_arch(arch: str | None) -> Family | None:
    """The family of a GGUF ``general.architecture`` (``llama`` files are Llama or Mistral, ``deepseek2`` files
    DeepSeek-V2 or V3: one code path each, the first family named), or None."""
    for f in FAMILIES.values():
        if f.gguf_arch == arch:
            return f
    return None


def supported_names() -> str:
    """``"llama, mistral, ..."`` with their HF model types and GGUF architectures, for error messages."""
    return ", ".join(f"{f.name} (model_type {'/'.join(f.hf_model_types)}, GGUF {f.gguf_arch!r})"
                     for f in FAMILIES.values())
