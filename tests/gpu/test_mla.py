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
from tests.gpu.tiny_families import build_hf, write_gguf

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, HF directory, GGUF path) of the tiny DeepSeek-V2."""
    d = tmp_path_factory.mktemp("deepseek2")
    hf = build_hf("deepseek2")
    hf.save_pretrained(str(d / "hf"))
    return hf, d / "hf", write_gguf("deepseek2", hf, d / "tiny.gguf")


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


def test_yarn_rope_equals_hf(tmp_path):
    """DeepSeek-V2-Lite's RoPE scaling kind (yarn, with mscale != mscale_all_dim so both the cos/sin factor and
    the attention scale's term count): prefill and decode logits equal HF's."""
    import transformers

    cfg = build_hf("deepseek2").config.to_dict()
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                              "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5,
                              "original_max_position_embeddings": 64}
    torch.manual_seed(2)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV2Config.from_dict(cfg),
                                                       dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + 1.0) if "norm" in name else p.normal_(0.0, 0.15)
    hf.eval().save_pretrained(str(tmp_path / "hf"))
    ours = LlamaModel.from_path(tmp_path / "hf", progress=False)
    assert ours.config.rope_scaling.rope_type == "yarn"
    ids = torch.randint(3, 49000, (12,), generator=torch.Generator().manual_seed(11)).tolist()
    kv = torch.full(kv_pool_shape(ours.config, 6, BLOCK), float("nan"))
    table = [4, 0, 5, 2, 1]
    got = [ours.prefill(kv, ids, table)]
    for i in range(5):
        got.append(ours.decode(kv, [int(got[-1].argmax())], [len(ids) + i], [table])[0])
    seq = ids + [int(g.argmax()) for g in got[:-1]]
    with torch.inference_mode():
        want = hf(torch.tensor([seq])).logits[0, len(ids) - 1:]
    assert (torch.stack(got) - want).abs().max().item() < 1e-4


def test_yarn_is_refused_for_a_family_whose_model_does_not_run_it(tiny, tmp_path):
    cfg = json.loads((tiny[1] / "config.json").read_text())
    d = tmp_path / "qwen2"
    d.mkdir()
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64}
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                               "rope_parameters": yarn}))
    with pytest.raises(ModelLoadError, match="'yarn' is not supported for qwen2"):
        load_config(d)
