"""Load a decoder's config and weights from a GGUF file or a Hugging Face directory, for every family in
gpu/families.py (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3, Qwen3-MoE, DeepSeek-V2).

Both sources end up as one :class:`ModelConfig` and a ``{hf_name: tensor}`` dict with Llama-style Hugging Face
names (``model.layers.{i}.self_attn.q_proj.weight``, ...) and values in HF layout (``[out_features,
in_features]``), so the model code has one path: fused ``qkv_proj`` / ``gate_up_proj`` (Phi-3) are split into
``q/k/v_proj`` and ``gate/up_proj``; norm weights keep HF's convention (Gemma's ``w`` of ``1 + w``).

GGUF files (llama.cpp) are dequantized to float with ``gguf.quants.dequantize``; llama.cpp's converter
permutes the rows of Q and K for its RoPE kernel in ``llama`` files, and adds 1 to Gemma's norm weights; we undo
both here so the weights equal the HF ones.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.errors import ModelLoadError

from .families import FAMILIES, Family, family, family_for_gguf_arch, family_for_hf, supported_names
from .model_files import default_model_path

if TYPE_CHECKING:   # annotations only: torch is imported where weights are read, so the supervisor (which
    import torch    # reads only the config) starts without it

__all__ = [
    "ModelConfig",
    "RopeScaling",
    "load_config",
    "load_weights",
    "resolve_model_path",
    "layer_weight_names",
    "unpermute_gguf_qk",
]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # yarn: MLA families only


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as in HF ``rope_scaling`` / ``rope_parameters``.

    ``rope_type`` is ``"linear"`` (every inverse frequency divided by ``factor``) or ``"llama3"`` (Llama 3.1's
    wavelength-dependent scaling; source: ``_compute_llama3_parameters`` in transformers'
    ``modeling_rope_utils.py``) or ``"yarn"`` (Peng et al. 2023, MLA families only: gpu/mla.py; frequencies
    blended between ``factor``-interpolated and original over the dims ``beta_fast`` .. ``beta_slow`` rotations
    mark, cos/sin times ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``; source:
    ``_compute_yarn_parameters``).
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    """Shape and constants of a decoder.

    ``head_dim`` is per head (any value, not necessarily ``hidden_size / num_heads``); ``max_position_embeddings``
    is the context length in tokens; ``rope_theta`` is the RoPE base; ``eos_token_ids`` holds every id that ends
    generation. ``rope_scaling`` is None for plain RoPE. GGUF files that carry a ``rope_freqs`` tensor (Llama
    3.1) get it as weight ``"rope_freqs"`` instead (inverse frequencies are divided by it, as llama.cpp does).

    Family traits (gpu/families.py) and what varies per checkpoint: ``family`` names the
    :class:`gpu.families.Family`; ``attn_scale`` multiplies Q.K (None = ``head_dim ** -0.5``; Gemma's
    ``query_pre_attn_scalar ** -0.5``); ``attn_softcap`` / ``final_softcap``: ``cap * tanh(x / cap)`` on the
    attention scores / the output logits (Gemma 2), None = off; ``layer_windows``: per layer, the sliding window
    in tokens (a query at ``p`` sees keys ``> p - window``), 0 = global attention, ``()`` = every layer global;
    ``local_rope_theta``: the RoPE base of sliding layers, which then run unscaled RoPE (Gemma 3), None = as global.
    Mixture of experts (``Family.moe``): ``moe_layers`` flags the sparse layers (the others have a dense MLP);
    each routes a token to ``experts_per_token`` of ``num_experts`` experts of ``moe_intermediate_size``, weighted
    by their softmax probabilities (renormalised over the chosen ones when ``norm_topk_prob``).

    Multi-head latent attention (``Family.attention == "mla"``, DeepSeek-V2): a token's cache row is its
    ``kv_lora_rank`` latent plus its ``qk_rope_head_dim`` rotary key, stored split over the pool's K and V planes:
    ``num_kv_heads`` is 1 and ``head_dim`` is half the row (an odd row is refused; so the pool, handoff and prefix cache
    carry latent rows unchanged); query/key heads are ``qk_nope_head_dim + qk_rope_head_dim`` wide, value heads
    ``v_head_dim``; ``attn_scale`` is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``. ``q_lora_rank`` > 0: the
    query is compressed (``q_a_proj`` to that rank, RMSNorm, ``q_b_proj``; DeepSeek-V2 full size, V3), 0: one
    ``q_proj`` (V2-Lite). ``rope_interleaved``: the rotary part pairs adjacent elements (DeepSeek's checkpoints;
    False: HF ``rope_interleave`` off, halves paired as Llama's). Its MoE layers add ``n_shared_experts``
    always-on experts and route within the ``topk_group`` best of ``n_group`` expert groups, weights times
    ``routed_scaling_factor``; ``moe_gating`` ``"softmax"`` (DeepSeek-V2: a group's score is its best expert's
    probability) or ``"sigmoid"`` (DeepSeek-V3's ``noaux_tc``: experts are chosen on their sigmoid score plus the
    router's ``e_score_correction_bias``, a group's score is the sum of its best two, the weights are the unbiased
    scores, renormalised when ``norm_topk_prob``).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_scaling: RopeScaling | None = None
    family: str = "llama"
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    q_lora_rank: int = 0
    rope_interleaved: bool = True
    moe_gating: str = "softmax"

    @property
    def spec(self) -> Family:
        """This config's :class:`gpu.families.Family`."""
        return family(self.family)


# ----------------------------------------------------------------------------------------------------------
# Paths


def resolve_model_path(path: str | os.PathLike | None) -> pathlib.Path:
    """``path`` as a ``Path``, or the default model when None.

    Raises:
        ModelLoadError: the path does not exist, or is neither a ``.gguf`` file nor a directory.
    """
    if path is None:
        return default_model_path()
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"{p}: no such model file or directory")
    if p.is_dir():
        return p
    if p.suffix.lower() != ".gguf":
        raise ModelLoadError(
            f"{p}: unsupported model file; pass a .gguf file or a Hugging Face directory with config.json "
            "and *.safetensors"
        )
    return p


# ----------------------------------------------------------------------------------------------------------
# Config


def load_config(path: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a model without reading its weights (fast enough for the API process).
    ``cache_dir``: the model cache holding a GGUF's header (``gpu.gguf_meta.read_gguf_header``); None = read it.

    Raises:
        ModelLoadError: the path is missing or unreadable, or the model's architecture is not supported (the
            message names the supported ones).
    """
    p = resolve_model_path(path)
    if p.is_dir():
        return _hf_config(p)
    from .gguf_meta import read_gguf_header

    meta, tensors = read_gguf_header(p, cache_dir=cache_dir)
    shapes = {t.name: t.shape for t in tensors}
    config = _gguf_config(meta, p)
    if "output.weight" in shapes or "token_embd.weight" in shapes:
        config = _with(config, tie_word_embeddings="output.weight" not in shapes,
                       vocab_size=shapes.get("token_embd.weight", (config.vocab_size,))[0])
    return config


def _with(config: ModelConfig, **changes: Any) -> ModelConfig:
    return ModelConfig(**{**config.__dict__, **changes})


def _gguf_config(meta: dict[str, Any], path: pathlib.Path) -> ModelConfig:
    arch = meta.get("general.architecture")
    fam = family_for_gguf_arch(arch)
    if fam is None:
        raise ModelLoadError(
            f"{path}: architecture {arch!r} is not supported; pdserve runs these GGUF architectures: "
            f"{', '.join(sorted({f.gguf_arch for f in FAMILIES.values()}))} ({supported_names()})"
        )

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise ModelLoadError(f"{path}: GGUF metadata key {full!r} is missing")
        return meta[full]

    def opt(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    n_experts = int(opt("expert_count", 0) or 0)
    if n_experts > 0 and not fam.moe:
        raise ModelLoadError(f"{path}: mixture-of-experts {arch} models are not supported")
    hidden = int(need("embedding_length"))
    n_kv = opt("attention.head_count_kv", need("attention.head_count"))
    if isinstance(need("attention.head_count"), np.ndarray) or isinstance(n_kv, np.ndarray):
        raise ModelLoadError(f"{path}: per-layer head counts are not supported")
    n_heads = int(need("attention.head_count"))
    n_kv = int(n_kv)
    n_layers = int(need("block_count"))
    head_dim = int(opt("attention.key_length", hidden // n_heads))
    rot_dim = int(opt("rope.dimension_count", head_dim))
    if rot_dim != head_dim and fam.attention != "mla":
        raise ModelLoadError(f"{path}: partial RoPE (rope.dimension_count {rot_dim} != head_dim {head_dim}) "
                             "is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = opt("vocab_size", len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ModelLoadError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")

    rope_scaling = _gguf_rope_scaling(opt, need, path, fam)
    windows = _gguf_windows(opt, fam.name, n_layers)
    scale = opt("attention.scale")
    local_theta = None
    if fam.name == "gemma3":
        local_theta = float(opt("rope.freq_base_swa", 10000.0))

    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = _gguf_eos_ids(meta)
    config = ModelConfig(
        name=str(meta.get("general.name") or path.stem),
        num_layers=n_layers,
        hidden_size=hidden,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        intermediate_size=int(need("feed_forward_length")),
        vocab_size=int(vocab),
        rope_theta=float(opt("rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings=True,  # refined from the tensor list: False when the file has output.weight
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
        rope_scaling=rope_scaling,
        family=fam.name,
        attn_scale=None if scale is None else float(scale),
        attn_softcap=_cap(opt("attn_logit_softcapping")),
        final_softcap=_cap(opt("final_logit_softcapping")),
        layer_windows=windows if any(windows) else (),
        local_rope_theta=local_theta,
        **({} if not fam.moe or fam.attention == "mla" else dict(
            num_experts=n_experts, experts_per_token=int(need("expert_used_count")),
            moe_intermediate_size=int(need("expert_feed_forward_length")),
            norm_topk_prob=bool(opt("expert_weights_norm", True)),  # llama.cpp's qwen3moe always renormalises
            moe_layers=(True,) * n_layers)),
    )
    return _with_mla(config, _gguf_mla(opt, need, path, n_layers)) if fam.attention == "mla" else config


def _check_mla_row(rank: int, rope: int, path: pathlib.Path) -> None:
    """Raises ModelLoadError unless the MLA cache row (latent + rotary key) splits evenly over the K and V planes."""
    if (rank + rope) % 2:
        raise ModelLoadError(f"{path}: kv_lora_rank + qk_rope_head_dim = {rank + rope} must be even (the MLA cache "
                             "row is split over the KV pool's K and V planes)")


def _gguf_mla(opt, need, path: pathlib.Path, n_layers: int) -> dict[str, Any]:
    """The MLA and MoE fields of a ``deepseek2`` GGUF (as ``_hf_mla``; DeepSeek-V3 files are ``deepseek2`` with
    ``expert_gating_func`` sigmoid and an ``exp_probs_b`` bias per sparse layer). llama.cpp's converter writes MLA
    as MQA over the latent (``key_length`` = rank + rope, the heads' widths in ``key_length_mla`` /
    ``value_length_mla``); older files have the heads' widths in ``key_length`` / ``value_length``."""
    gating = {1: "softmax", 2: "sigmoid"}.get(int(opt("expert_gating_func", 1) or 1))
    if gating is None:
        raise ModelLoadError(f"{path}: expert_gating_func {opt('expert_gating_func')} is not supported (1: softmax, "
                             "2: sigmoid)")
    if gating == "softmax" and opt("expert_weights_norm", False):
        raise ModelLoadError(f"{path}: renormalised softmax expert weights (expert_weights_norm) are not supported")
    rank, rope = int(need("attention.kv_lora_rank")), int(need("rope.dimension_count"))
    k_len = int(opt("attention.key_length_mla", 0) or need("attention.key_length"))
    v_len = int(opt("attention.value_length_mla", 0) or need("attention.value_length"))
    _check_mla_row(rank, rope, path)
    n_group = int(opt("expert_group_count", 1) or 1)
    first_sparse = int(opt("leading_dense_block_count", 0) or 0)
    return dict(num_kv_heads=1, head_dim=(rank + rope) // 2, attn_scale=k_len ** -0.5, kv_lora_rank=rank,
                qk_nope_head_dim=k_len - rope, qk_rope_head_dim=rope, v_head_dim=v_len,
                q_lora_rank=int(opt("attention.q_lora_rank", 0) or 0), moe_gating=gating,
                num_experts=int(need("expert_count")), experts_per_token=int(need("expert_used_count")),
                moe_intermediate_size=int(need("expert_feed_forward_length")),
                norm_topk_prob=bool(opt("expert_weights_norm", False)),
                n_shared_experts=int(opt("expert_shared_count", 0) or 0), n_group=n_group,
                topk_group=int(opt("expert_group_used_count", n_group) or n_group),
                routed_scaling_factor=float(opt("expert_weights_scale", 1.0) or 1.0),
                moe_layers=tuple(i >= first_sparse for i in range(n_layers)))


def _gguf_rope_scaling(opt, need, path: pathlib.Path, fam: Family) -> RopeScaling | None:
    """The GGUF's RoPE scaling (``opt(key, default)`` / ``need(key)`` read ``<arch>.<key>``): linear, or yarn for
    MLA families.
    llama.cpp's converter writes DeepSeek's yarn as ``rope.scaling.yarn_log_multiplier`` = 0.1 * ``mscale_all_dim``
    and runs cos/sin unscaled, i.e. HF's form with ``mscale == mscale_all_dim`` (as every DeepSeek config has it)."""
    stype = opt("rope.scaling.type", "none")
    if stype in ("none", "", None):
        return None
    factor = float(opt("rope.scaling.factor", 1.0))
    if stype == "yarn" and fam.attention == "mla":
        log_mul = float(opt("rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
        if log_mul <= 0 or float(opt("rope.scaling.attn_factor", 1.0) or 1.0) != 1.0:
            raise ModelLoadError(f"{path}: yarn needs rope.scaling.yarn_log_multiplier > 0 and no "
                                 "rope.scaling.attn_factor (as llama.cpp's converter writes DeepSeek's)")
        return RopeScaling("yarn", factor, original_max_position_embeddings=int(need(
            "rope.scaling.original_context_length")),
            beta_fast=float(opt("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(opt("rope.scaling.yarn_beta_slow", 1.0)), mscale=log_mul / 0.1,
            mscale_all_dim=log_mul / 0.1)
    if stype != "linear":
        raise ModelLoadError(f"{path}: RoPE scaling type {stype!r} is not supported for {fam.name} "
                             f"(only linear{', yarn' if fam.attention == 'mla' else ''}; llama3 via rope_freqs)")
    return RopeScaling("linear", factor) if factor != 1.0 else None


def _gguf_windows(opt, family: str, n_layers: int) -> tuple[int, ...]:
    """Per-layer sliding windows (0 = global): llama.cpp's defaults per architecture (Gemma 2: every other layer from
    the first; Gemma 3: five of every six), or the file's per-layer pattern when it has one; () without a window."""
    window = int(opt("attention.sliding_window", 0) or 0)
    if not window:
        return ()
    pattern = opt("attention.sliding_window_pattern")
    if pattern is not None and len(pattern) == n_layers:
        sliding = [bool(b) for b in pattern]
    elif family == "gemma2":
        sliding = [i % 2 == 0 for i in range(n_layers)]
    elif family == "gemma3":
        sliding = [i % 6 < 5 for i in range(n_layers)]
    else:
        sliding = [True] * n_layers
    return tuple(window if s else 0 for s in sliding)


def _gguf_eos_ids(meta: dict[str, Any]) -> list[int]:
    """The end-of-sequence ids a GGUF names (eos, eot, eom), each once, in that order."""
    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = meta.get(key)
        if v is not None and int(v) not in eos_ids:
            eos_ids.append(int(v))
    return eos_ids


def _cap(v: Any) -> float | None:
    return float(v) if v else None


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from None


def _id_list(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v]
    return [int(v)]


def _hf_rope(cfg: dict[str, Any], path: pathlib.Path) -> tuple[float, RopeScaling | None, float | None]:
    """``(theta, scaling, local_theta)``: global RoPE base and scaling, and the sliding layers' own base (Gemma 3:
    ``rope_parameters`` per layer type, or ``rope_local_base_freq`` in older configs), None when they share it."""
    # transformers >= 5 writes "rope_parameters" (rope_theta inside); older: "rope_theta" + "rope_scaling".
    params = cfg.get("rope_parameters") or {}
    local_theta = cfg.get("rope_local_base_freq")
    if "full_attention" in params:  # per layer type (Gemma 3)
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"{path}: sliding layers' rope type {local.get('rope_type')!r} is not supported")
        local_theta = local.get("rope_theta", local_theta)
        params = params["full_attention"] or {}
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise ModelLoadError(f"{path}: partial RoPE (partial_rotary_factor != 1) is not supported")
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or params
    rtype = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{path}: rope type {rtype!r} is not supported "
                             f"(supported: {SUPPORTED_ROPE_TYPES})")
    local = None if local_theta is None else float(local_theta)
    if rtype == "default":
        return float(theta), None, local
    factor = float(scaling.get("factor", 1.0))
    if rtype == "linear":
        return float(theta), RopeScaling("linear", factor), local
    if rtype == "yarn":
        if scaling.get("attention_factor") is not None or scaling.get("truncate", True) is not True:
            raise ModelLoadError(f"{path}: yarn's attention_factor / truncate are not supported")
        return float(theta), RopeScaling(
            "yarn", factor, original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1),
            mscale=float(scaling.get("mscale") or 0), mscale_all_dim=float(scaling.get("mscale_all_dim") or 0)), local
    return float(theta), RopeScaling(
        "llama3",
        factor,
        float(scaling.get("low_freq_factor", 1.0)),
        float(scaling.get("high_freq_factor", 4.0)),
        int(scaling.get("original_max_position_embeddings", 8192)),
    ), local


def _hf_layer_windows(cfg: dict[str, Any], fam: Family, n_layers: int) -> tuple[int, ...]:
    """Per-layer sliding windows (0 = global) as transformers builds them: ``layer_types`` when the config has
    them, else the family's rule (Qwen: layers from ``max_window_layers`` when ``use_sliding_window``; Gemma 2:
    every other layer; Gemma 3: ``sliding_window_pattern``; Mistral, Phi-3: every layer)."""
    window = int(cfg.get("sliding_window") or 0)
    if fam.name in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = 0
    if not window:
        return ()
    types = cfg.get("layer_types")
    if types:
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    elif fam.name in ("qwen2", "qwen3"):
        windows = tuple(window if i >= int(cfg.get("max_window_layers", 0)) else 0 for i in range(n_layers))
    elif fam.name in ("gemma2", "gemma3"):
        pattern = 2 if fam.name == "gemma2" else int(cfg.get("sliding_window_pattern", 6))
        windows = tuple(window if (i + 1) % pattern else 0 for i in range(n_layers))
    else:
        windows = (window,) * n_layers
    return windows if any(windows) else ()


def _hf_config(d: pathlib.Path) -> ModelConfig:
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{d}: config.json is missing (a Hugging Face model directory needs config.json "
                             "and *.safetensors)")
    cfg = _read_json(cfg_path)
    mtype = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    fam = family_for_hf(mtype, archs)
    if fam is None:
        raise ModelLoadError(f"{cfg_path}: model_type {mtype!r} (architectures {archs}) is not supported; "
                             f"pdserve runs: {supported_names()}")
    quant = cfg.get("quantization_config")
    if quant:  # e.g. DeepSeek-V3's own fp8 blocks: their weight_scale_inv tensors would be ignored
        raise ModelLoadError(f"{cfg_path}: quantized checkpoints (quantization_config, quant_method "
                             f"{quant.get('quant_method')!r}) are not supported; use a bfloat16/float32 checkpoint "
                             "or a GGUF")
    if (cfg.get("attention_bias") and not fam.qkv_bias) or cfg.get("mlp_bias"):
        raise ModelLoadError(f"{cfg_path}: attention_bias / mlp_bias are not supported for {fam.name}")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    want = {"silu": ("silu",), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh")}[fam.activation]
    if act not in want:
        raise ModelLoadError(f"{cfg_path}: activation {act!r} is not supported for {fam.name} (only {want[0]})")
    try:
        hidden = int(cfg["hidden_size"])
        n_heads = int(cfg["num_attention_heads"])
        n_layers = int(cfg["num_hidden_layers"])
        inter = int(cfg["intermediate_size"])
        vocab = int(cfg["vocab_size"])
    except KeyError as e:
        raise ModelLoadError(f"{cfg_path}: required key {e.args[0]!r} is missing") from None
    theta, scaling, local_theta = _hf_rope(cfg, cfg_path)
    eos = _id_list(cfg.get("eos_token_id"))
    gen_path = d / "generation_config.json"
    if gen_path.is_file():
        for i in _id_list(_read_json(gen_path).get("eos_token_id")):
            if i not in eos:
                eos.append(i)
    bos = cfg.get("bos_token_id")
    qpas = cfg.get("query_pre_attn_scalar")
    config = ModelConfig(
        name=d.resolve().name,
        num_layers=n_layers,
        hidden_size=hidden,
        num_heads=n_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or hidden // n_heads),
        intermediate_size=inter,
        vocab_size=vocab,
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos),
        rope_scaling=scaling,
        family=fam.name,
        attn_scale=float(qpas) ** -0.5 if qpas else None,
        attn_softcap=_cap(cfg.get("attn_logit_softcapping")),
        final_softcap=_cap(cfg.get("final_logit_softcapping")),
        layer_windows=_hf_layer_windows(cfg, fam, n_layers),
        local_rope_theta=(local_theta or 10000.0) if fam.name == "gemma3" else None,
        **({} if not fam.moe or fam.attention == "mla" else _hf_moe(cfg, n_layers, cfg_path)),
    )
    if scaling is not None and (scaling.rope_type == "yarn") != (fam.attention == "mla"):
        raise ModelLoadError(f"{cfg_path}: RoPE scaling {scaling.rope_type!r} is not supported for {fam.name} "
                             f"({'only yarn' if fam.attention == 'mla' else 'yarn is for MLA families only'})")
    if fam.attention != "mla":
        return config
    return _with_mla(config, _hf_mla(cfg, n_layers, cfg_path, fam))


def _with_mla(config: ModelConfig, mla: dict[str, Any]) -> ModelConfig:
    """``config`` with the MLA fields ``mla``, its attention scale times YaRN's ``mscale(factor, mscale_all_dim) ** 2``
    when it has one (HF's ``yarn_apply_mscale``)."""
    rs = config.rope_scaling
    if rs is not None and rs.rope_type == "yarn" and rs.mscale_all_dim:
        mla = {**mla, "attn_scale": mla["attn_scale"] * _yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2}
    return _with(config, **mla)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term ``0.1 * mscale * ln(factor) + 1`` (1 when ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# HF ``topk_method`` -> the ``scoring_func`` it runs with (``ModelConfig.moe_gating``) and whether experts are grouped
_MLA_ROUTING = {"greedy": ("softmax", False), "group_limited_greedy": ("softmax", True), "noaux_tc": ("sigmoid", True)}


def _hf_mla(cfg: dict[str, Any], n_layers: int, cfg_path: pathlib.Path, fam: Family) -> dict[str, Any]:
    """The MLA and MoE fields of a DeepSeek-V2/V3 config (``ModelConfig`` explains the pool row): layers from
    ``first_k_dense_replace`` on are sparse; ``topk_method`` (V2's default ``greedy``, V3's ``noaux_tc``; V3 configs
    written by transformers carry neither it nor ``scoring_func``) picks the routing."""
    method = cfg.get("topk_method") or ("noaux_tc" if fam.name == "deepseek3" else "greedy")
    if method not in _MLA_ROUTING:
        raise ModelLoadError(f"{cfg_path}: topk_method {method!r} is not supported ({', '.join(_MLA_ROUTING)})")
    gating, grouped = _MLA_ROUTING[method]
    if (cfg.get("scoring_func") or gating) != gating:
        raise ModelLoadError(f"{cfg_path}: scoring_func {cfg['scoring_func']!r} with topk_method {method!r} is not "
                             f"supported (that method runs {gating})")
    try:
        rank, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        nope, v_dim = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
        n_experts = int(cfg.get("n_routed_experts") or cfg["num_experts"])
        top_k, inter = int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"])
    except KeyError as e:
        raise ModelLoadError(f"{cfg_path}: required key {e.args[0]!r} is missing") from None
    _check_mla_row(rank, rope, cfg_path)
    first_sparse = int(cfg.get("first_k_dense_replace") or 0)
    return dict(num_kv_heads=1, head_dim=(rank + rope) // 2, attn_scale=(nope + rope) ** -0.5,
                kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v_dim,
                q_lora_rank=int(cfg.get("q_lora_rank") or 0), rope_interleaved=bool(cfg.get("rope_interleave", True)),
                num_experts=n_experts, experts_per_token=top_k, moe_intermediate_size=inter, moe_gating=gating,
                # HF's V2 router never renormalises; V3's does when the config says so
                norm_topk_prob=gating == "sigmoid" and bool(cfg.get("norm_topk_prob", False)),
                n_shared_experts=int(cfg.get("n_shared_experts") or 0),
                n_group=int(cfg.get("n_group") or 1) if grouped else 1,
                topk_group=int(cfg.get("topk_group") or 1) if grouped else 1,
                routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
                moe_layers=tuple(i >= first_sparse for i in range(n_layers)))


def _hf_moe(cfg: dict[str, Any], n_layers: int, cfg_path: pathlib.Path) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE config: sparse layers are those not in ``mlp_only_layers`` whose
    ``(i + 1)`` is a multiple of ``decoder_sparse_step`` (transformers' rule)."""
    step, dense = int(cfg.get("decoder_sparse_step", 1) or 1), set(cfg.get("mlp_only_layers") or [])
    try:
        # transformers >= 5 writes num_local_experts, older releases (and the published checkpoints) num_experts
        n_experts, top_k = int(cfg.get("num_experts") or cfg["num_local_experts"]), int(cfg["num_experts_per_tok"])
        inter = int(cfg["moe_intermediate_size"])
    except KeyError as e:
        raise ModelLoadError(f"{cfg_path}: required key {e.args[0]!r} is missing") from None
    return dict(num_experts=n_experts, experts_per_token=top_k, moe_intermediate_size=inter,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers)))


# ----------------------------------------------------------------------------------------------------------
# Weights


def unpermute_gguf_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    ``convert_hf_to_gguf.py`` (LlamaModel.permute) stores ``w.reshape(n_head, 2, rows // n_head // 2, *rest)
    .swapaxes(1, 2).reshape(w.shape)``, interleaving the two rotary halves of each head; this applies the
    inverse so the rows are in HF's rotate_half order again.

    Args:
        w: ``[n_head * head_dim, ...]`` the GGUF tensor in HF layout (rows = output features).
        n_head: heads in ``w`` (``num_heads`` for Q, ``num_kv_heads`` for K).
    Returns:
        ``[n_head * head_dim, ...]`` with HF's row order.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Qwen2: Q/K/V biases; Qwen3 / Gemma 3: per-head Q/K norms; Phi-3: fused QKV
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    # mixture of experts: the router and every expert's weights stacked [experts, out, in] (split on load)
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    # DeepSeek-V2/V3 (MLA): the compressed query's projections and norm, the latent projection and norm, kv_b
    # whole (older files) or split per head into k_b and v_b (joined on load), the shared experts, V3's router bias
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k_b.weight": "self_attn.k_b_proj.weight",
    "attn_v_b.weight": "self_attn.v_b_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
# Gemma 2/3 (sandwich norms): llama.cpp's ffn_norm is the MLP's pre-norm, post_attention_norm the attention's
# post-norm; Phi-3: ffn_up holds the fused gate and up rows
_GGUF_SANDWICH_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GGUF_FUSED_NAMES = {"ffn_up.weight": "mlp.gate_up_proj.weight"}


def layer_weight_names(fam: Family, num_experts: int = 0, q_lora: bool = False,
                       router_bias: bool = False) -> tuple[str, ...]:
    """The per-layer weight names (after ``model.layers.{i}.``) a model of ``fam`` needs, fused ones split;
    ``num_experts`` > 0: a sparse layer's (router and experts instead of the MLP). MLA only: ``q_lora``, a
    compressed query (``ModelConfig.q_lora_rank``); ``router_bias``, the sigmoid router's correction bias."""
    names = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight"]
    names += ["self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight"] \
        if q_lora else ["self_attn.q_proj.weight"]
    if fam.attention == "mla":
        names += ["self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
                  "self_attn.kv_b_proj.weight"]
        if num_experts:
            names += [f"mlp.shared_experts.{x}_proj.weight" for x in ("gate", "up", "down")]
        if num_experts and router_bias:
            names.append("mlp.gate.e_score_correction_bias")
    else:
        names += ["self_attn.k_proj.weight", "self_attn.v_proj.weight"]
    if num_experts:
        names += ["mlp.gate.weight"] + [f"mlp.experts.{e}.{x}_proj.weight" for e in range(num_experts)
                                        for x in ("gate", "up", "down")]
    else:
        names += ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    if fam.qkv_bias:
        names += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    if fam.qk_norm:
        names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if fam.sandwich_norms:
        names += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    return tuple(names)


def _gguf_to_hf_name(name: str, fam: Family = FAMILIES["llama"]) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    table = {**_GGUF_LAYER_NAMES, **(_GGUF_SANDWICH_NAMES if fam.sandwich_norms else {}),
             **(_GGUF_FUSED_NAMES if fam.fused else {})}
    hf = table.get(parts[2])
    return None if hf is None else f"model.layers.{parts[1]}.{hf}"


def load_weights(
    path: str | os.PathLike | None,
    *,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    native: bool = False,
) -> tuple[ModelConfig, dict[str, Any]]:
    """Read a model's config and all its weights with Hugging Face names and layout, dequantized unless
    ``native``.

    Args:
        path: a ``.gguf`` file (llama.cpp, ``general.architecture`` of a family in gpu/families.py), a Hugging
            Face directory (``config.json`` + ``*.safetensors``, such a family), or None for the default model
            (:func:`gpu.model_files.default_model_path`).
        dtype: dtype of every returned tensor (None: ``torch.float32``).
        progress: show a tqdm bar over tensors on stderr.
        native: keep a GGUF's Q4_0/Q4_1/Q4_K linear weights as :class:`gpu.quant.Int4Groups`, its Q8_0 ones as
            :class:`gpu.quant.Int8Groups` (its own codes), its Q5_K/Q5_0/Q5_1 ones as :class:`gpu.quant.Int5Groups`
            and its Q6_K ones as :class:`gpu.quant.Int8HalfGroups`; every other tensor is dequantized to ``dtype``.
    Returns:
        ``(config, weights)``; weights maps HF names to CPU tensors (or packed weights, see ``native``),
        linear weights ``[out, in]``, norms
        ``[hidden]``, ``model.embed_tokens.weight`` ``[vocab, hidden]``; ``lm_head.weight`` only when the
        model has its own; ``rope_freqs`` ``[head_dim // 2]`` only for GGUF files that carry it.
    Raises:
        ModelLoadError: naming the path and what is missing or unsupported.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    p = resolve_model_path(path)
    if p.is_dir():
        config = _hf_config(p)
        weights = _load_safetensors(p, dtype, progress)
    else:
        config, weights = _load_gguf(p, dtype, progress, native)
    _split_fused(config, weights)
    _check_weights(config, weights, p)
    return config, weights


def _split_fused(config: ModelConfig, weights: dict[str, Any]) -> None:
    """Phi-3's fused ``qkv_proj`` ``[(H + 2 Hkv) D, hidden]`` and ``gate_up_proj`` ``[2 I, hidden]`` (gate rows
    first) into Llama's separate weights, in place (packed low-bit weights split by rows too)."""
    import torch

    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for name in [n for n in weights if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]:
        w = weights.pop(name)
        if name.endswith("qkv_proj.weight"):
            pre, bounds = name[:-len("qkv_proj.weight")], [("q", 0, q_rows), ("k", q_rows, q_rows + kv_rows),
                                                         ("v", q_rows + kv_rows, q_rows + 2 * kv_rows)]
            parts = {f"{pre}{x}_proj.weight": (a, b) for x, a, b in bounds}
        else:
            pre, half = name[:-len("gate_up_proj.weight")], w.shape[0] // 2
            parts = {f"{pre}gate_proj.weight": (0, half), f"{pre}up_proj.weight": (half, 2 * half)}
        for part, (a, b) in parts.items():
            weights[part] = w[a:b].contiguous() if isinstance(w, torch.Tensor) else w.take_rows(np.arange(a, b))


def _load_gguf(
    p: pathlib.Path, dtype: torch.dtype, progress: bool, native: bool = False
) -> tuple[ModelConfig, dict[str, Any]]:
    import torch
    from tqdm import tqdm

    from .gguf_meta import open_gguf, read_gguf_metadata

    config = _gguf_config(read_gguf_metadata(p), p)
    fam = config.spec
    reader = open_gguf(str(p))

    unknown = [t.name for t in reader.tensors if _gguf_to_hf_name(t.name, fam) is None]
    if unknown:
        raise ModelLoadError(f"{p}: unsupported tensors for a {fam.name} model: {unknown[:5]}"
                             f"{' ...' if len(unknown) > 5 else ''}")
    weights: dict[str, Any] = {}
    for t in tqdm(reader.tensors, desc=f"loading {p.name}", unit="tensor", disable=not progress):
        hf_name = _gguf_to_hf_name(t.name, fam)
        heads = {"q_proj.weight": config.num_heads, "k_proj.weight": config.num_kv_heads}.get(
            hf_name.rsplit(".", 2)[-2] + ".weight") if fam.gguf_permuted_qk else None
        packed = _native_weight(t, hf_name, heads) if native else None
        if packed is not None:
            weights[hf_name] = packed
            continue
        arr = _dequantize(t, p)
        if ".mlp.experts." in hf_name:  # [experts, out, in] -> one weight per expert, as HF names them
            pre, x = hf_name.rsplit(".experts.", 1)
            for e in range(arr.shape[0]):
                weights[f"{pre}.experts.{e}.{x}"] = torch.from_numpy(np.array(arr[e], dtype=np.float32)).to(dtype)
            continue
        if heads is not None:
            arr = unpermute_gguf_qk(arr, heads)
        if fam.norm_offset and hf_name.endswith("norm.weight"):
            arr = arr - np.float32(fam.norm_offset)  # llama.cpp's converter stored offset + w
        if not (arr.flags.writeable and arr.flags.c_contiguous and arr.flags.owndata):
            arr = np.array(arr, dtype=np.float32, order="C")  # detach from the file's memory map
        weights[hf_name] = torch.from_numpy(arr).to(dtype)
    del reader
    _join_kv_b(weights)
    config = _with(config, tie_word_embeddings="lm_head.weight" not in weights)
    if "model.embed_tokens.weight" in weights:
        config = _with(config, vocab_size=int(weights["model.embed_tokens.weight"].shape[0]))
    return config, weights


def _join_kv_b(weights: dict[str, Any]) -> None:
    """DeepSeek-V2 GGUFs from newer converters: ``k_b`` ``[H, rank, nope]`` and ``v_b`` ``[H, v, rank]`` back into
    HF's ``kv_b_proj`` ``[H * (nope + v), rank]`` (per head: the nope rows, then the v rows), in place."""
    import torch

    for name in [n for n in weights if n.endswith("self_attn.k_b_proj.weight")]:
        k_b, v_b = weights.pop(name), weights.pop(name.replace("k_b_proj", "v_b_proj"))
        kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [H, nope + v, rank]
        weights[name.replace("k_b_proj", "kv_b_proj")] = kv_b.reshape(-1, kv_b.shape[-1]).contiguous()


def _dequantize(t, p: pathlib.Path) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    except NotImplementedError:
        raise ModelLoadError(f"{p}: tensor {t.name} has quantization {t.tensor_type.name}, which "
                             "gguf.quants cannot dequantize") from None


def _native_weight(t, hf_name: str, heads: int | None):
    """A GGUF linear weight kept quantized (Q4_0/Q4_1/Q4_K -> Int4Groups, Q8_0 -> Int8Groups, Q5_K/Q5_0/Q5_1 ->
    Int5Groups, Q6_K -> Int8HalfGroups), Q/K rows unpermuted; None for norms and every other type (the caller dequantizes those)."""
    from .quant import KQUANT_TYPES, Q4_TYPES, int4_groups_from_gguf, int8_groups_from_float, \
        kquant_groups_from_gguf

    kind = t.tensor_type.name
    shape = tuple(int(n) for n in reversed(t.shape))  # [out, in]
    if len(shape) != 2 or hf_name.endswith(("norm.weight", "mlp.gate.weight")) or kind not in (
            Q4_TYPES + KQUANT_TYPES + ("Q8_0",)):
        return None
    if kind == "Q8_0":
        import torch
        from gguf.quants import dequantize

        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if heads is not None:
            w = unpermute_gguf_qk(w, heads)
        return int8_groups_from_float(torch.from_numpy(np.ascontiguousarray(w)))
    groups = (int4_groups_from_gguf if kind in Q4_TYPES else kquant_groups_from_gguf)(t.data, kind, shape)
    if heads is not None:
        order = unpermute_gguf_qk(np.arange(shape[0]), heads)  # the row order the float path ends with
        groups = groups.take_rows(order)
    return groups


def _load_safetensors(d: pathlib.Path, dtype: torch.dtype, progress: bool) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    from tqdm import tqdm

    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{d}: no *.safetensors weight files (only safetensors weights are supported)")
    weights: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        handles = []
        for f in files:
            try:
                handles.append(stack.enter_context(safe_open(str(f), framework="pt")))
            except Exception as e:  # safetensors raises its own SafetensorError
                raise ModelLoadError(f"{f}: cannot read safetensors ({e})") from None
        keys = [(h, k) for h in handles for k in h.keys()]
        for h, k in tqdm(keys, desc=f"loading {d.name}", unit="tensor", disable=not progress):
            weights[k] = h.get_tensor(k).to(dtype)
    return weights


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], p: pathlib.Path) -> None:
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    sparse = config.moe_layers or (False,) * config.num_layers
    need += [f"model.layers.{i}.{s}" for i in range(config.num_layers)
             for s in layer_weight_names(config.spec, config.num_experts if sparse[i] else 0, config.q_lora_rank > 0,
                                         config.moe_gating == "sigmoid")]
    missing = [n for n in need if n not in weights]
    if missing:
        raise ModelLoadError(f"{p}: {len(missing)} weight(s) missing, e.g. {missing[:3]}")
    if not config.tie_word_embeddings and "lm_head.weight" not in weights:
        raise ModelLoadError(f"{p}: lm_head.weight is missing and tie_word_embeddings is false")
    h, d = config.hidden_size, config.head_dim
    expect = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.layers.0.self_attn.q_proj.weight": (config.num_heads * d, h),
        "model.layers.0.self_attn.k_proj.weight": (config.num_kv_heads * d, h),
    }
    if config.spec.attention == "mla":
        c = config
        q_rows = c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
        expect = {"model.embed_tokens.weight": (c.vocab_size, h),
                  **({"model.layers.0.self_attn.q_a_proj.weight": (c.q_lora_rank, h),
                      "model.layers.0.self_attn.q_b_proj.weight": (q_rows, c.q_lora_rank)} if c.q_lora_rank else
                     {"model.layers.0.self_attn.q_proj.weight": (q_rows, h)}),
                  "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, h),
                  "model.layers.0.self_attn.kv_b_proj.weight": (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim),
                                                                c.kv_lora_rank)}
    if config.moe_layers and config.moe_layers[0]:
        expect["model.layers.0.mlp.gate.weight"] = (config.num_experts, h)
        expect["model.layers.0.mlp.experts.0.gate_proj.weight"] = (config.moe_intermediate_size, h)
    else:
        expect["model.layers.0.mlp.gate_proj.weight"] = (config.intermediate_size, h)
    for name, shape in expect.items():
        got = tuple(weights[name].shape)
        if got != shape:
            raise ModelLoadError(f"{p}: {name} has shape {list(got)}, the config implies {list(shape)}")
    if math.prod(weights["model.norm.weight"].shape) != h:
        raise ModelLoadError(f"{p}: model.norm.weight does not have hidden_size={h} elements")
