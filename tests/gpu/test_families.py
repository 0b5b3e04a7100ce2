"""Every family in gpu/families.py against Hugging Face's own implementation, on tiny random-weight models
(tests/gpu/tiny_families.py) loaded from an HF directory and from a GGUF written as llama.cpp's converter writes
that family: the logits of a prefill (every position) and of 16 greedy decode steps equal HF's forward over the
same ids to float32 tolerance, and the greedy tokens equal HF ``generate``'s. Windows of 8 tokens, blocks of 4,
a NaN-filled pool and scattered block ids: a sliding-window, RoPE-table or block-mapping mistake shows up.
"""
from __future__ import annotations

import json

import pytest
import torch

from gpu.families import FAMILIES as SPECS
from gpu.loader import load_config
from gpu.model import DENSE_MIN_TOKENS, LlamaModel, kv_pool_shape
from pdserve.errors import ModelLoadError
from tests.gpu.tiny_families import FAMILIES, build_hf, write_gguf

BLOCK = 4
STEPS = 16
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """Per family: (HF model, HF directory, GGUF path)."""
    out = {}
    for name in FAMILIES:
        d = tmp_path_factory.mktemp(name)
        model = build_hf(name)
        model.save_pretrained(str(d / "hf"))
        out[name] = (model, d / "hf", write_gguf(name, model, d / f"tiny-{name}.gguf"))
    return out


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def nan_pool(model: LlamaModel, blocks: int) -> torch.Tensor:
    return torch.full(kv_pool_shape(model.config, blocks, BLOCK), float("nan"))


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()  # [T, vocab]


def test_every_family_is_tested():
    assert set(FAMILIES) == set(SPECS)


@pytest.mark.parametrize("form", ["hf", "gguf"])
@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_and_decode_logits_and_greedy_tokens_equal_hf(tiny, name, form):
    hf, hf_dir, gguf_path = tiny[name]
    ours = LlamaModel.from_path(hf_dir if form == "hf" else gguf_path, progress=False)
    # a llama GGUF is Llama's code, a deepseek2 one DeepSeek-V2's (V3's routing comes from the file's keys)
    assert ours.config.family == name or (name in ("mistral", "deepseek3") and form == "gguf")
    ids = prompt(1, 20)
    table = torch.randperm(40, generator=torch.Generator().manual_seed(2))[:10].tolist()
    kv = nan_pool(ours, 40)
    pre = ours.prefill(kv, ids, table, all_logits=True)  # [20, vocab]
    worst = (pre - hf_logits(hf, ids)).abs().max().item()
    assert worst < TOL, worst
    tokens, steps = [int(pre[-1].argmax())], [pre[-1]]
    for i in range(STEPS):
        logits = ours.decode(kv, [tokens[-1]], [len(ids) + i], [table])[0]
        steps.append(logits)
        tokens.append(int(logits.argmax()))
    ref = hf_logits(hf, ids + tokens[:-1])[len(ids) - 1:]  # the positions that predicted our tokens
    worst = (torch.stack(steps) - ref).abs().amax(dim=1)
    assert worst.max().item() < TOL, worst.tolist()
    with torch.inference_mode():
        x = torch.tensor([ids])
        g = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=STEPS + 1,
                        eos_token_id=None, pad_token_id=2)
    assert tokens == g[0, len(ids):].tolist()


@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_prefill_and_a_ragged_decode_batch_equal_hf(tiny, name):
    """Sequence A prefilled in two chunks (the second reads the first from the pool, as after a prefix-cache
    hit), B in one; then both decode together (different lengths: padded keys, windows per row)."""
    hf, hf_dir, _ = tiny[name]
    ours = LlamaModel.from_path(hf_dir, progress=False)
    kv = nan_pool(ours, 40)
    a, b = prompt(3, 21), prompt(4, 9)
    ta, tb = list(range(39, 29, -1)), [1, 7, 5, 12, 14, 3]
    ours.prefill(kv, a[:12], ta)
    first = ours.prefill_packed(kv, [a[12:], b], [ta, tb], [12, 0], [True, False])
    assert (first[0] - hf_logits(hf, a)[12:]).abs().max().item() < TOL
    seqs = {"a": (a, ta, [int(first[0][-1].argmax())]), "b": (b, tb, [int(first[1].argmax())])}
    got = {"a": [], "b": []}
    for step in range(6):
        out = ours.decode(kv, [s[2][-1] for s in seqs.values()], [len(s[0]) + step for s in seqs.values()],
                          [s[1] for s in seqs.values()])
        for row, (key, s) in enumerate(seqs.items()):
            got[key].append(out[row])
            s[2].append(int(out[row].argmax()))
    for key, (ids, _, toks) in seqs.items():
        ref = hf_logits(hf, ids + toks[:-1])[len(ids):]
        assert (torch.stack(got[key]) - ref).abs().max().item() < TOL, key


@pytest.mark.parametrize("name", ["qwen2", "gemma2", "gemma3", "qwen3_moe", "deepseek2", "deepseek3"])
def test_the_prepared_state_rebuilds_the_same_model(tiny, name):
    # gpu/prepared.py caches to_state(): biases, q/k norms, post-norms and the local RoPE table must survive it
    ours = LlamaModel.from_path(tiny[name][1], progress=False)
    again = LlamaModel.from_state(*ours.to_state())
    ids = prompt(5, 14)
    assert torch.equal(ours.prefill(nan_pool(ours, 8), ids, [4, 2, 6, 0], all_logits=True),
                       again.prefill(nan_pool(again, 8), ids, [4, 2, 6, 0], all_logits=True))


def test_configs_carry_the_family_traits(tiny):
    g3 = load_config(tiny["gemma3"][1])
    assert (g3.family, g3.layer_windows, g3.local_rope_theta, g3.rope_theta) == ("gemma3", (8, 8, 0), 10000.0, 1e6)
    g2 = load_config(tiny["gemma2"][2])
    assert (g2.attn_softcap, g2.final_softcap, g2.layer_windows) == (5.0, 8.0, (8, 0, 8))
    assert abs(g2.attn_scale - 32 ** -0.5) < 1e-7
    assert load_config(tiny["mistral"][1]).head_dim == 24 != 64 // 4
    assert load_config(tiny["qwen2"][1]).layer_windows == (0, 8, 8)
    assert load_config(tiny["qwen2"][2]).layer_windows == (0, 8, 8)
    for path in tiny["qwen3_moe"][1:]:
        moe = load_config(path)
        assert (moe.num_experts, moe.experts_per_token, moe.moe_intermediate_size, moe.norm_topk_prob,
                moe.moe_layers) == (4, 2, 32, True, (True, True, True))


def test_an_unknown_architecture_is_refused_naming_the_supported_ones(tmp_path, tiny):
    cfg = json.loads((tiny["llama"][1] / "config.json").read_text())
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match=r"'gpt2'.*not supported.*qwen3.*gemma3"):
        load_config(d)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "phi3", "qwen3_moe"])
def test_low_bit_weights_run_every_family_and_the_one_call_decode_only_llama_layers(tiny, name, tmp_path):
    """``--weights auto`` on a Q4_0 GGUF: prefill runs the float32 copies (equal to the dequantized model, so the
    per-row prefill attention is too, windows and soft-capping included; on the low-bit kernels, ``dense_min_tokens``
    raised, close to it), decode steps the int8-activation kernels from layer 0's projections on, through
    ``lowbit_cpu.decode_layers`` where the layer is Llama's (Llama; Phi-3 once its fused weights are split) and op
    by op for the others."""
    path = write_gguf(name, tiny[name][0], tmp_path / f"tiny-{name}-q4.gguf", linear_type="Q4_0")
    native = LlamaModel.from_path(path, progress=False, weights="auto")
    dense = LlamaModel.from_path(path, progress=False, weights="float32")
    assert (native._stack_layers() is not None) == (name in ("llama", "phi3"))
    ids = prompt(6, 20)
    kv_n, kv_d = nan_pool(native, 12), nan_pool(dense, 12)
    table = list(range(11, -1, -1))
    pre_n, pre_d = native.prefill(kv_n, ids, table), dense.prefill(kv_d, ids, table)
    assert (pre_n - pre_d).abs().max().item() < TOL
    native.dense_min_tokens = 1 << 30
    try:
        low_bit = native.prefill(nan_pool(native, 12), ids, table)
    finally:
        native.dense_min_tokens = DENSE_MIN_TOKENS
    # int8-rounded activations from layer 0 on: close to the float32 numbers, not equal (2-8% of the largest
    # logit on these random tiny models, 2% for a decode step)
    assert 0 < (low_bit - pre_d).abs().max().item() < 0.12 * pre_d.abs().max().item()
    t = int(pre_d.argmax())
    for i in range(4):
        p = len(ids) + i
        step_n = native.decode(kv_n, [t], [p], [table])[0]
        step_d = dense.decode(kv_d, [t], [p], [table])[0]
        # int8-rounded activations: close to the float32 numbers, not equal
        assert 0 < (step_n - step_d).abs().max().item() < 0.05 * step_d.abs().max().item()
        # already in layer 0's Q/K/V projection (same float32 embedding in), not only in the int8 output projection
        new_kv = (slice(None), table[p // BLOCK], p % BLOCK)
        assert (kv_n[0][new_kv] - kv_d[0][new_kv]).abs().max().item() > 0
        t = int(step_d.argmax())
