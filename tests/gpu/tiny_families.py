"""Tiny random-weight models of every family in gpu/families.py, built with transformers' own config and model classes,
saved as a Hugging Face directory and written as a GGUF the way llama.cpp's convert_hf_to_gguf.py writes that family
(architecture name, tensor names, Q/K permutation for ``llama``, ``1 + w`` Gemma norms, fused Phi-3 weights,
DeepSeek-V2's MLA keys and per-head ``attn_k_b`` / ``attn_v_b``, DeepSeek-V3 as a ``deepseek2`` file with sigmoid
gating and its router bias as ``exp_probs_b``). Both carry the embedded SmolLM2 tokenizer (its
vocabulary size, tokenizer files / GGUF tokenizer metadata with the chat template), so the engine can serve them;
:func:`save_with_formats` instead gives them their family's own chat template (tests/data/chat_templates) and its
markers as special tokens appended to the vocabulary (:data:`FAMILY_FORMATS`).

Shapes: 3 layers, hidden 64, 4 query heads over 2 KV heads, head_dim 16 (Mistral: 24, not hidden / heads), sliding
windows of 8 tokens where the family has them, so a 20-token prompt plus 16 decode steps crosses them. DeepSeek-V2:
4 heads of 16 + 8 (Q/K) and 12 (V), a latent of 32 (V3: the same, with a compressed query of rank 24), see
:func:`hf_config`.
"""
from __future__ import annotations

import functools
import pathlib

import gguf
import numpy as np
import torch

from gpu.model_files import default_model_path

VOCAB = 49152  # SmolLM2's
WINDOW = 8
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3_moe", "deepseek2", "deepseek3")
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
              intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=2)


def hf_config(name: str, vocab_size: int = VOCAB):
    """The transformers config of the tiny ``name`` model (``vocab_size``: SmolLM2's, or more for the special
    tokens :func:`save_with_formats` adds)."""
    import transformers as t

    common = {**COMMON, "vocab_size": vocab_size}

    if name == "llama":
        return t.LlamaConfig(**common, head_dim=16, tie_word_embeddings=True)
    if name == "mistral":
        return t.MistralConfig(**common, head_dim=24, sliding_window=WINDOW)
    if name == "qwen2":
        return t.Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if name == "qwen3":
        return t.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    if name == "phi3":
        return t.Phi3Config(**common)
    if name == "gemma2":
        return t.Gemma2Config(**common, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=32,
                              attn_logit_softcapping=5.0, final_logit_softcapping=8.0)
    if name == "gemma3":
        return t.Gemma3TextConfig(
            **common, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    if name == "qwen3_moe":  # 4 experts of 32, top 2, in every layer
        return t.Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True)
    if name == "deepseek2":  # MLA: latent 32 + rope 8 per token; 8 experts in 4 groups (best 2 kept), top 3,
        # 1 shared expert; layer 0 dense. HF's MLA expands K/V to every query head: kv heads = heads
        return t.DeepseekV2Config(**{**common, "num_key_value_heads": 4}, kv_lora_rank=32, q_lora_rank=None,
                                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                                  n_shared_experts=1, num_experts_per_tok=3, moe_intermediate_size=24,
                                  first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4,
                                  topk_group=2, routed_scaling_factor=1.5)
    if name == "deepseek3":  # V2's MLA shape with a compressed query (rank 24); 12 experts in 4 groups of 3 (so a
        # group's best two are neither its best nor its sum), best 2 groups, top 3, renormalised, sigmoid routing
        return t.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, kv_lora_rank=32, q_lora_rank=24,
                                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=12,
                                  n_shared_experts=1, num_experts_per_tok=3, moe_intermediate_size=24,
                                  first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
                                  routed_scaling_factor=2.5)
    raise KeyError(name)


def build_hf(name: str, seed: int = 0, vocab_size: int = VOCAB):
    """HF's model of the tiny ``name`` config with every weight random (norms too, so ``1 + w`` matters)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name, vocab_size), dtype=torch.float32,
                                                          attn_implementation="eager")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(torch.randn_like(p) * 0.2 + (0.0 if name.startswith("gemma") else 1.0))
            else:
                p.normal_(0.0, 0.15)
        for bname, b in model.named_buffers():  # DeepSeek-V3's router bias (zeros as initialised)
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model.eval()


def save_hf_dir(model, hf_tok, d: pathlib.Path) -> pathlib.Path:
    """``model`` (safetensors + config.json) and the SmolLM2 tokenizer files in directory ``d``."""
    model.save_pretrained(str(d))
    hf_tok.save_pretrained(str(d))
    return d


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute (Q/K rows interleaved for llama.cpp's RoPE)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(name: str, model, path: pathlib.Path, linear_type: str = "F32",
               kv_b_split: bool = True, specials: tuple[str, ...] = (),
               chat_template: str | None = None) -> pathlib.Path:
    """``model`` as a GGUF under ``name``'s llama.cpp architecture, with SmolLM2's tokenizer metadata; the layers'
    linear weights in ``linear_type`` (``F32``, or ``Q4_0`` / ``Q8_0`` quantized with ``gguf.quants`` where their
    rows are whole 32-wide blocks), the rest float32. ``kv_b_split`` False: DeepSeek-V2's ``kv_b_proj`` as one
    ``attn_kv_b`` (older converters) instead of per-head ``attn_k_b`` / ``attn_v_b``. ``specials``: control
    tokens appended to SmolLM2's vocabulary; ``chat_template``: ``tokenizer.chat_template`` instead of SmolLM2's."""
    cfg = model.config
    arch = {"mistral": "llama", "qwen3_moe": "qwen3moe", "deepseek3": "deepseek2"}.get(name, name)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{name}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    if arch == "deepseek2":  # convert_hf_to_gguf.py's DeepseekV2Model: MLA written as MQA over the latent
        w.add_head_count_kv(1)
        if cfg.q_lora_rank:
            w.add_q_lora_rank(cfg.q_lora_rank)
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
        w.add_kv_lora_rank(cfg.kv_lora_rank)
        w.add_rope_dimension_count(cfg.qk_rope_head_dim)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        v3 = name == "deepseek3"  # the converter reads the gating from the config's scoring_func
        w.add_expert_weights_norm(bool(v3 and cfg.norm_topk_prob))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
        rope = cfg.rope_parameters
        if rope.get("rope_type") == "yarn":  # DeepseekV2Model: yarn_log_multiplier = 0.1 * mscale_all_dim
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
            w.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    else:
        w.add_head_count_kv(cfg.num_key_value_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    params = cfg.rope_parameters
    w.add_rope_freq_base(float((params.get("full_attention") or params)["rope_theta"]))
    types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    if window:
        w.add_sliding_window(window)
        if types:
            w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    if name == "gemma3":
        w.add_key_value(f"{arch}.rope.freq_base_swa", float(params["sliding_attention"]["rope_theta"]),
                        gguf.GGUFValueType.FLOAT32)
    if name.startswith("gemma"):
        w.add_key_value(f"{arch}.attention.scale", float(cfg.query_pre_attn_scalar) ** -0.5,
                        gguf.GGUFValueType.FLOAT32)
        if getattr(cfg, "attn_logit_softcapping", None):
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if getattr(cfg, "final_logit_softcapping", None):
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if name == "qwen3_moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    _copy_tokenizer_metadata(w, specials, chat_template)

    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up",
             "mlp.gate": "ffn_gate_inp", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
             "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
             "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
             "self_attn.q_b_proj": "attn_q_b", "mlp.gate.e_score_correction": "exp_probs_b",
             "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
             "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
             "post_attention_layernorm": "post_attention_norm" if name.startswith("gemma") else "ffn_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = t.detach().float().numpy().copy()
        if hf_name.endswith("kv_b_proj.weight") and kv_b_split:  # per head: k_b [H, rank, nope], v_b [H, v, rank]
            kv_b = arr.reshape(cfg.num_attention_heads, -1, cfg.kv_lora_rank)
            i = hf_name.split(".")[2]
            w.add_tensor(f"blk.{i}.attn_k_b.weight",
                         np.ascontiguousarray(kv_b[:, :cfg.qk_nope_head_dim].transpose(0, 2, 1), dtype=np.float32))
            w.add_tensor(f"blk.{i}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, cfg.qk_nope_head_dim:],
                                                                           dtype=np.float32))
            continue
        if ".mlp.experts." in hf_name:  # transformers' fused [experts, 2 I, hidden] (gate rows first), [E, hidden, I]
            i = hf_name.split(".")[2]
            if hf_name.endswith("gate_up_proj"):
                half = arr.shape[1] // 2
                parts = {f"blk.{i}.ffn_gate_exps.weight": arr[:, :half], f"blk.{i}.ffn_up_exps.weight": arr[:, half:]}
            else:
                parts = {f"blk.{i}.ffn_down_exps.weight": arr}
            for out, part in parts.items():
                w.add_tensor(out, np.ascontiguousarray(part, dtype=np.float32))
            continue
        if hf_name.startswith("model.layers."):
            _, _, i, rest = hf_name.split(".", 3)
            # gguf's tensor map reads V3's router bias as module e_score_correction, kind bias
            module, kind = rest.rsplit(".", 1) if not rest.endswith("_bias") else (rest[:-len("_bias")], "bias")
            out = f"blk.{i}.{layer[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                arr = _permute(arr, cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads)
        else:
            out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}[hf_name]
        if name.startswith("gemma") and out.endswith("norm.weight"):
            arr = arr + 1.0  # Gemma2Model/Gemma3Model.modify_tensors in convert_hf_to_gguf.py
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        # rows not a whole number of 32-wide blocks stay float32 (llama.cpp's converter falls back so too)
        if linear_type != "F32" and out.startswith("blk.") and out.endswith(".weight") and arr.ndim == 2 \
                and arr.shape[1] % 32 == 0:
            qtype = gguf.GGMLQuantizationType[linear_type]
            w.add_tensor(out, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(out, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _copy_tokenizer_metadata(w: gguf.GGUFWriter, specials: tuple[str, ...] = (),
                             chat_template: str | None = None) -> None:
    for key, value, vtype, sub in _tokenizer_metadata():
        if key == "tokenizer.ggml.tokens":
            value = [*value, *specials]
        elif key == "tokenizer.ggml.token_type":
            value = [*value, *[int(gguf.TokenType.CONTROL)] * len(specials)]
        elif key == "tokenizer.chat_template" and chat_template is not None:
            value = chat_template
        w.add_key_value(key, value, vtype, sub)


@functools.lru_cache(maxsize=1)
def _tokenizer_metadata() -> tuple:
    """The embedded SmolLM2 GGUF's ``tokenizer.*`` fields as (key, value, type, array item type), read once per
    process (parsing that file's metadata takes seconds)."""
    reader = gguf.GGUFReader(str(default_model_path()))
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            out.append((key, field.contents(), vtype, field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None))
    return tuple(out)


TEMPLATES = pathlib.Path(__file__).resolve().parents[1] / "data" / "chat_templates"
DEEPSEEK_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                     "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                     "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                     "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
# family (or family-variant) -> (its chat template in tests/data/chat_templates, the special tokens its model files
# declare: appended to SmolLM2's vocabulary, so the template's markers are one token each, as in the family's real
# tokenizer)
FAMILY_FORMATS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qwen3": ("qwen3_thinking.jinja", ("<tool_call>", "</tool_call>", "<think>", "</think>")),
    "mistral": ("mistral_v3.jinja", ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                     "[TOOL_RESULTS]", "[/TOOL_RESULTS]")),
    "llama": ("llama3_1_json.jinja", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                                      "<|python_tag|>")),
    "deepseek2": ("deepseek_r1.jinja", DEEPSEEK_SPECIALS),
    "deepseek2-v31": ("deepseek_v31.jinja", DEEPSEEK_SPECIALS)}


def save_with_formats(name: str, d: pathlib.Path, form: str, seed: int = 0) -> pathlib.Path:
    """The tiny ``name`` model (a :data:`FAMILY_FORMATS` key: the family, or family-variant for another template)
    with its family's chat template and special tokens, as a
    Hugging Face directory (``form`` "hf": ``tokenizer.json`` with the added tokens, ``tokenizer_config.json``'s
    ``chat_template``) or a GGUF ("gguf": control tokens, ``tokenizer.chat_template``) under ``d``; its path."""
    import json

    from tokenizers import AddedToken

    from gpu.tokenizer import Tokenizer

    template_file, specials = FAMILY_FORMATS[name]
    template = (TEMPLATES / template_file).read_text(encoding="utf-8")
    name = name.split("-")[0]
    model = build_hf(name, seed, vocab_size=VOCAB + len(specials))
    if form == "gguf":
        return write_gguf(name, model, d / f"tiny-{name}.gguf", specials=specials, chat_template=template)
    path = d / f"tiny-{name}"
    model.save_pretrained(str(path))
    backend = Tokenizer.load(None).backend
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    assert backend.get_vocab_size(with_added_tokens=True) == VOCAB + len(specials)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}), encoding="utf-8")
    return path


GPU_CHECK_FAMILIES = ("llama", "deepseek2")  # one of each attention kind: GQA, MLA


def save_bf16_hf_dir(name: str, d: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """The tiny ``name`` model with every weight rounded to bfloat16 and saved in bfloat16 (so a float32 reference and
    the engine's bf16 weights hold the same values; half the bytes: what the GPU device check carries), SmolLM2's
    ``tokenizer.json`` and chat template, in ``d / tiny-<name>``; its path."""
    import json

    from gpu.tokenizer import Tokenizer

    model = build_hf(name, seed)
    path = d / f"tiny-{name}"
    model.to(torch.bfloat16).save_pretrained(str(path))
    tok = Tokenizer.load(None)
    tok.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tok.chat_template, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}),
        encoding="utf-8")
    return path


if __name__ == "__main__":   # python -m tests.gpu.tiny_families DIR: the GPU device check's models (its --prepare)
    import sys

    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for family in GPU_CHECK_FAMILIES:
        print(save_bf16_hf_dir(family, out))
