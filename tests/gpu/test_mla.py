"""The MLA family (DeepSeek-V2, gpu/mla.py) beyond tests/gpu/test_families.py's logits: the pool holds exactly the
latent rows HF's own cache holds (normed latent + rotated key, nothing decompressed), its size per token is
``layers * (kv_lora_rank + qk_rope_head_dim) * dtype bytes``, and the group-limited routing is the one HF runs.
"""
from __future__ import annotations

import json

import pytest
import torch

from gpu.loader import load_config
from gpu.model import LlamaModel, kv_bytes_per_token, kv_pool_shape
from pdserve.errors import ModelLoadError
from tests.gpu.tiny_families import VOCAB, build_hf, write_gguf

BLOCK = 4


def saved(name: str, tmp_path_factory) -> tuple:
    """(HF model, HF directory, GGUF path) of the tiny ``name`` family model."""
    d = tmp_path_factory.mktemp(name)
    hf = build_hf(name)
    hf.save_pretrained(str(d / "hf"))
    return hf, d / "hf", write_gguf(name, hf, d / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny DeepSeek-V2 (:func:`saved`)."""
    return saved("deepseek2", tmp_path_factory)


@pytest.mark.parametrize("form", [1, 2])
def test_the_config_reads_the_latent_layout_and_routing(tiny, form):
    c = load_config(tiny[form])
    assert (c.family, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim) == (
        "deepseek2", 32, 8, 16, 12)
    assert (c.num_experts, c.experts_per_token, c.n_shared_experts, c.n_group, c.topk_group) == (8, 3, 1, 4, 2)
    assert (c.moe_layers, c.routed_scaling_factor, c.num_kv_heads, c.head_dim) == ((False, True, True), 1.5, 1, 20)
    assert abs(c.attn_scale - 24 ** -0.5) < 1e-9


def test_the_pool_holds_latent_rows_of_the_formula_size(tiny):
    hf, hf_dir, _ = tiny
    ours = LlamaModel.from_path(hf_dir, progress=False)
    c = ours.config
    for dtype in (torch.float32, torch.bfloat16):
        assert kv_bytes_per_token(c, dtype) == c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * \
            dtype.itemsize == 3 * 40 * dtype.itemsize
    kv = torch.full(kv_pool_shape(c, 8, BLOCK), float("nan"))
    assert kv[0, 0, 0].numel() * 2 * kv.element_size() * c.num_layers == kv_bytes_per_token(c, kv.dtype) * BLOCK
    ids = torch.randint(3, 49000, (11,), generator=torch.Generator().manual_seed(7)).tolist()
    table = [5, 2, 7]
    ours.prefill(kv, ids, table)
    with torch.inference_mode():
        cache = hf(torch.tensor([ids]), use_cache=True).past_key_values
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(ids))])
    flat = kv.view(c.num_layers, 2, -1, c.head_dim)  # [L, 2, slots, 20]
    for li in range(c.num_layers):
        rows = torch.cat([flat[li, 0, slots], flat[li, 1, slots]], dim=-1)  # [T, 40]
        # HF's cache: the normed latent as "keys" [1, 1, T, 32], the rotated shared key as "values" [1, 1, T, 8]
        want = torch.cat([cache.layers[li].keys[0, 0], cache.layers[li].values[0, 0]], dim=-1)
        assert (rows - want).abs().max().item() < 1e-5, li


def test_group_limited_routing_decides_experts(tiny):
    """Routing over every expert instead of the best groups' picks other experts for some of these tokens (so
    the logits tests would see a routing mistake), and ours equals HF's router output."""
    hf, hf_dir, _ = tiny
    ours = LlamaModel.from_path(hf_dir, progress=False)
    h = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    router = hf.model.layers[1].mlp.gate
    with torch.inference_mode():
        _, w_hf, idx_hf = router(h)
        got = ours._moe(ours.layers[1], h, False)
        want = hf.model.layers[1].mlp(h[None])[0]
    assert (got - want).abs().max().item() < 1e-5
    greedy = torch.topk(torch.softmax(h @ router.weight.T, dim=-1), 3, dim=-1).indices
    differ = [set(a) != set(b) for a, b in zip(greedy.tolist(), idx_hf.tolist())]
    assert 0 < sum(differ) < len(differ)


def test_low_bit_weights_run_dequantized(tiny, tmp_path):
    """``--weights auto`` on a Q4_0 GGUF: the family has no low-bit path, so it runs the dequantized weights,
    exactly as ``float32`` does, and says so."""
    path = write_gguf("deepseek2", tiny[0], tmp_path / "tiny-q4.gguf", linear_type="Q4_0")
    auto = LlamaModel.from_path(path, progress=False, weights="auto")
    dense = LlamaModel.from_path(path, progress=False, weights="float32")
    assert auto.weights_mode == "float32"
    ids = torch.randint(3, 49000, (9,), generator=torch.Generator().manual_seed(8)).tolist()
    pools = [torch.full(kv_pool_shape(m.config, 4, BLOCK), float("nan")) for m in (auto, dense)]
    assert torch.equal(auto.prefill(pools[0], ids, [3, 1, 0]), dense.prefill(pools[1], ids, [3, 1, 0]))



def test_an_odd_latent_row_is_refused(tiny, tmp_path):
    """The row splits evenly over the K and V planes; every DeepSeek checkpoint's is even (512 + 64), and HF's own
    complex RoPE cannot run an odd one either."""
    cfg = json.loads((tiny[1] / "config.json").read_text())
    d = tmp_path / "odd"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**cfg, "kv_lora_rank": 31}))
    with pytest.raises(ModelLoadError, match=r"kv_lora_rank \+ qk_rope_head_dim = 39 must be even"):
        load_config(d)


def test_an_older_gguf_with_one_kv_b_tensor_loads_the_same_model(tiny, tmp_path):
    old = write_gguf("deepseek2", tiny[0], tmp_path / "tiny-kv-b.gguf", kv_b_split=False)
    ids = torch.randint(3, 49000, (9,), generator=torch.Generator().manual_seed(10)).tolist()
    models = [LlamaModel.from_path(p, progress=False) for p in (old, tiny[2])]
    pools = [torch.full(kv_pool_shape(m.config, 4, BLOCK), float("nan")) for m in models]
    got = [m.prefill(kv, ids, [1, 3, 0], all_logits=True) for m, kv in zip(models, pools)]
    assert torch.equal(got[0], got[1])


def variant(name: str, **changes):
    """HF's tiny ``name`` model (tests/gpu/tiny_families.py) with config ``changes``, random weights."""
    import transformers

    cfg = build_hf(name).config.to_dict() | changes
    cls = transformers.DeepseekV3Config if name == "deepseek3" else transformers.DeepseekV2Config
    torch.manual_seed(2)
    hf = transformers.AutoModelForCausalLM.from_config(cls.from_dict(cfg), dtype=torch.float32,
                                                       attn_implementation="eager")
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + 1.0) if "norm" in pname else p.normal_(0.0, 0.15)
        for bname, b in hf.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return hf.eval()


def assert_equals_hf(hf, path, steps: int = 5) -> LlamaModel:
    """Our model of ``path``: a 12-token prefill and ``steps`` greedy decode steps give HF's logits."""
    ours = LlamaModel.from_path(path, progress=False)
    ids = torch.randint(3, 49000, (12,), generator=torch.Generator().manual_seed(11)).tolist()
    kv = torch.full(kv_pool_shape(ours.config, 6, BLOCK), float("nan"))
    table = [4, 0, 5, 2, 1]
    got = [ours.prefill(kv, ids, table)]
    for i in range(steps):
        got.append(ours.decode(kv, [int(got[-1].argmax())], [len(ids) + i], [table])[0])
    seq = ids + [int(g.argmax()) for g in got[:-1]]
    with torch.inference_mode():
        want = hf(torch.tensor([seq])).logits[0, len(ids) - 1:]
    assert (torch.stack(got) - want).abs().max().item() < 1e-4
    return ours


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 64}


def test_yarn_rope_equals_hf(tmp_path):
    """DeepSeek-V2-Lite's RoPE scaling kind (yarn, with mscale != mscale_all_dim so both the cos/sin factor and
    the attention scale's term count): prefill and decode logits equal HF's."""
    hf = variant("deepseek2", rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.5})
    hf.save_pretrained(str(tmp_path / "hf"))
    assert assert_equals_hf(hf, tmp_path / "hf").config.rope_scaling.rope_type == "yarn"


def test_a_yarn_gguf_reads_its_scaling_from_the_metadata(tmp_path):
    """llama.cpp's converter writes DeepSeek's yarn as rope.scaling.* keys with yarn_log_multiplier = 0.1 *
    mscale_all_dim (mscale == mscale_all_dim in every DeepSeek config, 0.707 in V2's): equal to HF's logits; a
    file without the multiplier is refused."""
    hf = variant("deepseek2", rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707})
    path = write_gguf("deepseek2", hf, tmp_path / "yarn.gguf")
    rs = assert_equals_hf(hf, path).config.rope_scaling
    assert (rs.rope_type, rs.factor, rs.original_max_position_embeddings) == ("yarn", 4.0, 64)
    assert abs(rs.mscale_all_dim - 0.707) < 1e-6
    with pytest.raises(ModelLoadError, match="yarn_log_multiplier"):
        load_config(metadata_without(path, tmp_path / "no-mul.gguf", "deepseek2.rope.scaling.yarn_log_multiplier"))


def metadata_without(src, dst, drop: str, add: tuple = ()):
    """A tensor-less GGUF at ``dst`` with ``src``'s model metadata (no tokenizer: ``vocab_size`` instead) less key
    ``drop``, plus ``add`` (key, value, type)."""
    import gguf

    w = gguf.GGUFWriter(str(dst), "deepseek2")
    w.add_vocab_size(VOCAB)
    for key, field in gguf.GGUFReader(str(src)).fields.items():
        if not key.startswith(("GGUF.", "general.architecture", "tokenizer.")) and key != drop:
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub)
    if add:
        w.add_key_value(*add)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return dst


def test_an_unknown_gguf_gating_function_is_refused(tiny, tmp_path):
    import gguf

    key = "deepseek2.expert_gating_func"
    path = metadata_without(tiny[2], tmp_path / "gating.gguf", key, (key, 3, gguf.GGUFValueType.UINT32))
    with pytest.raises(ModelLoadError, match="expert_gating_func 3 is not supported"):
        load_config(path)


def test_a_compressed_query_equals_hf_from_both_forms(tmp_path):
    """DeepSeek-V2 at full size has q_lora_rank (q_a_proj -> RMSNorm -> q_b_proj; GGUF attn_q_a, attn_q_a_norm,
    attn_q_b): logits equal HF's from the HF directory and the GGUF."""
    hf = variant("deepseek2", q_lora_rank=24)
    hf.save_pretrained(str(tmp_path / "hf"))
    for path in (tmp_path / "hf", write_gguf("deepseek2", hf, tmp_path / "q-lora.gguf")):
        ours = assert_equals_hf(hf, path)
        assert (ours.config.q_lora_rank, ours.layers[0].q) == (24, None)


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    """The tiny DeepSeek-V3 (:func:`saved`)."""
    return saved("deepseek3", tmp_path_factory)


def test_v3_reads_its_routing_from_both_forms(tiny3):
    for path in tiny3[1:]:
        c = load_config(path)
        assert (c.moe_gating, c.norm_topk_prob, c.q_lora_rank, c.num_experts, c.n_group, c.topk_group) == (
            "sigmoid", True, 24, 12, 4, 2)
        assert (c.routed_scaling_factor, c.moe_layers, c.rope_interleaved) == (2.5, (False, True, True), True)


def test_v3_routing_equals_hf_and_its_bias_and_group_rule_decide_experts(tiny3):
    """Ours equals HF's ``DeepseekV3MoE`` on 64 random rows; ranking without the correction bias, or groups by
    their best expert (V2's rule) instead of their best two, would pick other experts for some of these rows."""
    hf = tiny3[0]
    ours = LlamaModel.from_path(tiny3[1], progress=False)
    h = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    router = hf.model.layers[1].mlp.gate
    with torch.inference_mode():
        _, _, idx_hf = router(h)
        got = ours._moe(ours.layers[1], h, False)
        want = hf.model.layers[1].mlp(h[None])[0]
    assert (got - want).abs().max().item() < 1e-5
    scores = torch.sigmoid(h @ router.weight.T)
    groups = (scores + router.e_score_correction_bias).view(64, 4, 3)

    def picks(choice, group_rank):
        keep = torch.zeros(64, 4, dtype=torch.bool).scatter_(1, group_rank.topk(2, dim=-1).indices, True)
        return choice.masked_fill(~keep[..., None], float("-inf")).view(64, 12).topk(3, dim=-1).indices.tolist()

    hf_sets = [set(r) for r in idx_hf.tolist()]
    assert hf_sets == [set(r) for r in picks(groups, groups.topk(2, dim=-1).values.sum(-1))]
    for other in (picks(scores.view(64, 4, 3), scores.view(64, 4, 3).topk(2, dim=-1).values.sum(-1)),
                  picks(groups, groups.amax(dim=-1))):
        differ = [set(a) != b for a, b in zip(other, hf_sets)]
        assert 0 < sum(differ) < len(differ)


def test_v3_with_rope_interleave_off_equals_hf(tmp_path):
    """A V3 config may set rope_interleave false (HF then rotates the halves, as Llama)."""
    hf = variant("deepseek3", rope_interleave=False)
    hf.save_pretrained(str(tmp_path / "hf"))
    assert assert_equals_hf(hf, tmp_path / "hf").config.rope_interleaved is False


@pytest.mark.parametrize("changes, message", [
    ({"topk_method": "sparse"}, "topk_method 'sparse' is not supported"),
    ({"topk_method": "noaux_tc", "scoring_func": "softmax"}, "scoring_func 'softmax' with topk_method 'noaux_tc'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "quantization_config.*'fp8'.*not supported")])
def test_unsupported_routing_is_refused_naming_it(tiny, tmp_path, changes, message):
    cfg = json.loads((tiny[1] / "config.json").read_text())
    d = tmp_path / "bad"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**cfg, **changes}))
    with pytest.raises(ModelLoadError, match=message):
        load_config(d)


def test_yarn_is_refused_for_a_family_whose_model_does_not_run_it(tiny, tmp_path):
    cfg = json.loads((tiny[1] / "config.json").read_text())
    d = tmp_path / "qwen2"
    d.mkdir()
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64}
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                               "rope_parameters": yarn}))
    with pytest.raises(ModelLoadError, match="'yarn' is not supported for qwen2"):
        load_config(d)


def test_an_embedding_of_the_mla_family_is_hf_s_last_hidden_state_and_its_logits_stay_logits(tiny):
    """prefill_forward with a ``hidden`` chunk beside a plain one through the MLA executor: the hidden chunk gets
    ``[T, hidden_size]`` equal to HF's ``last_hidden_state`` (after the final norm), the other its last token's
    ``[vocab]`` logits (the executor's norm shape once shadowed the ``hidden`` flags: a prompt got every
    position's hidden state and the prefill actor died)."""
    from actors.model_runner import prefill_forward

    hf, _, path = tiny
    ours = LlamaModel.from_path(path, progress=False)
    ids = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    kv = torch.full(kv_pool_shape(ours.config, 6, BLOCK), float("nan"))
    (states, _), (logits, _) = prefill_forward(ours, kv, [(ids, 0, 9, [0, 1, 2], False, True),
                                                         (ids, 0, 9, [3, 4, 5], False)])
    with torch.inference_mode():
        want = hf.model(torch.tensor([ids])).last_hidden_state[0]
        want_logits = hf(torch.tensor([ids])).logits[0, -1]
    assert states.shape == (9, ours.config.hidden_size) and (states - want).abs().max().item() < 1e-4
    assert logits.shape == (ours.config.vocab_size,) and (logits - want_logits).abs().max().item() < 1e-4
