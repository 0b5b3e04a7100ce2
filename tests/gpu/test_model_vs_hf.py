"""Our paged-KV Llama against Hugging Face's LlamaForCausalLM on the same weights.

The default model (SmolLM2-135M-Instruct Q4_1 GGUF) is dequantized by both sides; greedy generation must
agree token for token for 32 tokens (EOS ignored on both sides), and the logits of the prefill and of every decode
step agree with HF's forward over the same ids to 1e-3. The KV pool is filled with NaN and the blocks are
scattered, so any read of a slot the model did not write, or a wrong block mapping, shows up.
"""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
import transformers

from gpu.loader import ModelConfig, load_config, load_weights, unpermute_gguf_qk
from gpu.model import LlamaModel, kv_bytes_per_token, kv_pool_shape
from gpu.tokenizer import Tokenizer
from pdserve.errors import ModelLoadError

BLOCK_TOKENS = 16
NEW_TOKENS = 32
EOS = 2

PASSAGE = (
    "The history of computing is a story of people trying to make arithmetic cheaper. In the seventeenth "
    "century, Blaise Pascal built a mechanical calculator to help his father add up taxes, and Gottfried "
    "Leibniz improved it so that it could multiply. Two centuries later Charles Babbage designed the "
    "Analytical Engine, a machine with a store, a mill and punched cards for its program, and Ada Lovelace "
    "wrote what many consider the first algorithm intended for such a machine. Neither engine was finished "
    "in their lifetimes. During the Second World War, engineers in Britain and the United States built "
    "electronic machines to break codes and to compute firing tables; these machines filled rooms, used "
    "thousands of vacuum tubes and failed often. The invention of the transistor in 1947 and of the "
    "integrated circuit about a decade later made computers smaller, faster and far more reliable. By the "
    "nineteen-seventies a whole processor fit on one chip, and by the nineteen-eighties people bought "
    "personal computers for their homes. The internet then connected these machines, and the smartphone put "
    "one in almost every pocket. Today the same basic ideas, a stored program, memory and a processor that "
    "fetches and executes instructions, run everything from washing machines to the data centres that train "
    "large language models. Each step made computation cheaper by orders of magnitude, and each time people "
    "found new problems that had been too expensive to attempt before."
)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


PROMPTS = {
    "france": ("chat", "What is the capital of France?"),
    "long": ("chat", "Summarize the following text in two sentences.\n\n" + PASSAGE),
    "non_ascii": ("chat", "Traduis en anglais : « Le café est très chaud, fais attention ! » Et dis "
                          "bonjour en japonais : こんにちは、元気ですか？ 😀"),
    "completion": ("plain", "The quick brown fox jumps over the lazy dog. Once upon a time, in a small "
                            "village by the sea,"),
}


def make_pool(model: LlamaModel, num_blocks: int) -> torch.Tensor:
    """A KV pool filled with NaN, so reading a slot the model never wrote poisons the logits."""
    return torch.full(kv_pool_shape(model.config, num_blocks, BLOCK_TOKENS), float("nan"), dtype=model.dtype)


def scattered_blocks(n: int, num_blocks: int, seed: int) -> list[int]:
    """``n`` distinct, shuffled (non-contiguous) block ids out of ``num_blocks``."""
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:n].tolist()


def blocks_for(n_tokens: int) -> int:
    return (n_tokens - 1) // BLOCK_TOKENS + 1


def greedy(model: LlamaModel, kv: torch.Tensor, ids: list[int], table: list[int], n: int,
           stop: tuple[int, ...] = (EOS,)) -> list[int]:
    """Prefill ``ids`` then decode greedily, one sequence: at most ``n`` new tokens, ending at a stop id."""
    return greedy_with_logits(model, kv, ids, table, n, stop)[0]


def greedy_with_logits(model: LlamaModel, kv: torch.Tensor, ids: list[int], table: list[int], n: int,
                       stop: tuple[int, ...] = (EOS,)) -> tuple[list[int], torch.Tensor]:
    """``greedy``, also returning the logits each token was picked from: ``[len(tokens), vocab]`` (row 0 from
    the prefill, the others from decode steps)."""
    logits = model.prefill(kv, ids, table)
    out: list[int] = []
    steps: list[torch.Tensor] = []
    pos = len(ids)
    while True:
        steps.append(logits)
        t = int(logits.argmax())
        out.append(t)
        if t in stop or len(out) == n:
            return out, torch.stack(steps)
        logits = model.decode(kv, [t], [pos], [table])[0]
        pos += 1


@pytest.fixture(scope="module")
def prompt_ids(tok) -> dict[str, list[int]]:
    ids = {}
    for name, (kind, text) in PROMPTS.items():
        ids[name] = tok.encode(tok.apply_chat_template(chat(text)) if kind == "chat" else text)
    assert len(ids["long"]) > 300
    return ids


@pytest.fixture(scope="module")
def generations(model, hf_model, prompt_ids) -> dict[str, dict]:
    """Per prompt, exactly NEW_TOKENS greedy tokens on each side, EOS ignored on both (an EOS is just the argmax
    of its step, and generation goes on): ``ours`` with the logits of each step (``our_logits``,
    ``[NEW_TOKENS, vocab]``), ``hf`` from HF's generate, and ``hf_logits``: HF's forward over the prompt and our
    tokens, at the positions that predicted them (``[NEW_TOKENS, vocab]``)."""
    out = {}
    for i, (name, ids) in enumerate(prompt_ids.items()):
        n_blocks = blocks_for(len(ids) + NEW_TOKENS)
        kv = make_pool(model, 3 * n_blocks)
        ours, our_logits = greedy_with_logits(model, kv, ids, scattered_blocks(n_blocks, 3 * n_blocks, seed=i),
                                              NEW_TOKENS, stop=())
        with torch.inference_mode():
            x = torch.tensor([ids])
            g = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS,
                                  eos_token_id=None)
            full = torch.tensor([ids + ours[:-1]])
            hf_logits = hf_model(full).logits[0, len(ids) - 1:].float()
        out[name] = {"ours": ours, "our_logits": our_logits, "hf": g[0, len(ids):].tolist(), "hf_logits": hf_logits}
    return out


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_generation_matches_hf_token_for_token(generations, name):
    ours, hf = generations[name]["ours"], generations[name]["hf"]
    assert len(ours) == len(hf) == NEW_TOKENS
    assert ours == hf


@pytest.mark.parametrize("name", list(PROMPTS))
def test_every_decode_step_logits_match_hf_forward_over_the_same_ids(generations, name):
    ours, hf = generations[name]["our_logits"], generations[name]["hf_logits"]
    assert ours.dtype == torch.float32 and ours.shape == hf.shape == (NEW_TOKENS, ours.shape[1])
    worst = (ours - hf).abs().amax(dim=1)   # per step
    assert worst.max().item() < 1e-3, [round(v, 5) for v in worst.tolist()]


def test_the_france_answer_is_paris(generations, tok):
    ours = generations["france"]["ours"]
    assert tok.decode(ours).startswith("The capital of France is Paris.")


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prefill_logits_match_hf_at_every_position(model, hf_model, prompt_ids, name):
    ids = prompt_ids[name]
    n_blocks = blocks_for(len(ids))
    kv = make_pool(model, 2 * n_blocks)
    ours = model.prefill(kv, ids, scattered_blocks(n_blocks, 2 * n_blocks, seed=7), all_logits=True)
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.dtype == torch.float32 and ours.shape == (len(ids), model.config.vocab_size)
    assert (ours - ref).abs().max().item() < 1e-3
    last = model.prefill(make_pool(model, n_blocks), ids, list(range(n_blocks)))
    assert last.shape == (model.config.vocab_size,)
    assert (last - ref[-1]).abs().max().item() < 1e-3


def test_prefill_in_chunks_equals_prefill_at_once(model, prompt_ids):
    ids = prompt_ids["long"]
    n_blocks = blocks_for(len(ids) + 4)
    table = scattered_blocks(n_blocks, 2 * n_blocks, seed=3)
    whole = model.prefill(make_pool(model, 2 * n_blocks), ids, table, all_logits=True)
    kv = make_pool(model, 2 * n_blocks)
    cuts = [0, 37, 160, len(ids)]  # chunk edges inside and on block boundaries
    parts = [model.prefill(kv, ids[a:b], table, start_pos=a, all_logits=True) for a, b in zip(cuts, cuts[1:])]
    assert (torch.cat(parts) - whole).abs().max().item() < 1e-3
    nxt = int(whole[-1].argmax())
    after = model.decode(kv, [nxt], [len(ids)], [table])[0]
    kv2 = make_pool(model, 2 * n_blocks)
    model.prefill(kv2, ids, table)
    assert (after - model.decode(kv2, [nxt], [len(ids)], [table])[0]).abs().max().item() < 1e-3


def test_a_packed_prefill_gives_each_sequence_the_logits_of_its_prefill_alone(model, prompt_ids):
    """Batched prefill (``prefill_packed``): sequences of different lengths, one of them a later chunk of a
    prompt whose first chunk ran alone, share one forward; each gets the logits its own ``prefill`` gives, and
    the KV it wrote decodes to the same next logits."""
    names = ["long", "france", "completion", "non_ascii"]
    prompts = [prompt_ids[n] for n in names]
    assert len({len(p) for p in prompts}) == len(prompts)
    sizes = [blocks_for(len(p) + 1) for p in prompts]
    pool_blocks = 2 * sum(sizes)
    order = scattered_blocks(sum(sizes), pool_blocks, seed=11)
    tables = [order[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(prompts))]
    alone_kv = make_pool(model, pool_blocks)
    alone = [model.prefill(alone_kv, p, t, all_logits=True) for p, t in zip(prompts, tables)]
    kv = make_pool(model, pool_blocks)
    cut = 70   # the long prompt's first chunk runs alone, its rest inside the packed forward
    model.prefill(kv, prompts[0][:cut], tables[0])
    packed = model.prefill_packed(kv, [prompts[0][cut:]] + prompts[1:], tables, [cut, 0, 0, 0],
                                  [True, False, True, False])
    assert packed[0].shape == (len(prompts[0]) - cut, model.config.vocab_size)
    assert packed[1].shape == (model.config.vocab_size,)
    assert (packed[0] - alone[0][cut:]).abs().max().item() < 1e-3
    assert (packed[2] - alone[2]).abs().max().item() < 1e-3
    for i in (1, 3):
        assert (packed[i] - alone[i][-1]).abs().max().item() < 1e-3
    nxt = [int(a[-1].argmax()) for a in alone]
    positions = [len(p) for p in prompts]
    after_packed = model.decode(kv, nxt, positions, tables)
    assert (after_packed - model.decode(alone_kv, nxt, positions, tables)).abs().max().item() < 1e-3


def test_a_packed_prefill_rejects_mismatched_lists(model):
    kv = make_pool(model, 4)
    with pytest.raises(ValueError, match="equal, non-zero"):
        model.prefill_packed(kv, [[1, 2]], [[0], [1]], [0])
    with pytest.raises(ValueError, match="equal, non-zero"):
        model.prefill_packed(kv, [], [], [])


def batched_greedy(model: LlamaModel, kv: torch.Tensor, prompts: list[list[int]], tables: list[list[int]],
                   steps: int) -> list[list[int]]:
    """Prefill each prompt, then decode all of them together for ``steps`` tokens (EOS ignored)."""
    last = torch.stack([model.prefill(kv, ids, t) for ids, t in zip(prompts, tables)])  # [B, vocab]
    out: list[list[int]] = [[] for _ in prompts]
    positions = [len(p) for p in prompts]
    for step in range(steps):
        toks = last.argmax(-1).tolist()
        for o, t in zip(out, toks):
            o.append(t)
        if step == steps - 1:
            return out
        last = model.decode(kv, toks, positions, tables)
        positions = [p + 1 for p in positions]
    return out


def test_batched_decode_gives_each_sequence_its_own_tokens(model, prompt_ids, tok):
    prompts = [prompt_ids["france"], prompt_ids["completion"], prompt_ids["non_ascii"], tok.encode("Hi")]
    assert len({len(p) for p in prompts}) == 4
    steps = 12
    alone = []
    for i, ids in enumerate(prompts):
        nb = blocks_for(len(ids) + steps)
        alone.append(greedy(model, make_pool(model, nb), ids, list(range(nb)), steps, stop=()))
    sizes = [blocks_for(len(p) + steps) for p in prompts]
    ids_all = scattered_blocks(sum(sizes), sum(sizes) + 8, seed=11)
    tables, at = [], 0
    for s in sizes:
        tables.append(ids_all[at:at + s])
        at += s
    kv = make_pool(model, sum(sizes) + 8)
    assert batched_greedy(model, kv, prompts, tables, steps) == alone


def test_batched_decode_of_equal_lengths_needs_no_mask(model, prompt_ids):
    ids = prompt_ids["france"]
    steps = 6
    nb = blocks_for(len(ids) + steps)
    alone = greedy(model, make_pool(model, nb), ids, list(range(nb)), steps, stop=())
    kv = make_pool(model, 2 * nb + 3)
    tables = [list(range(3, 3 + 2 * nb, 2)), list(range(4, 4 + 2 * nb, 2))]  # interleaved blocks
    assert batched_greedy(model, kv, [ids, ids], tables, steps) == [alone, alone]


def test_bad_arguments_are_rejected_before_touching_the_pool(model):
    kv = make_pool(model, 4)
    with pytest.raises(ValueError, match="block table"):
        model.prefill(kv, list(range(20)), [0])
    with pytest.raises(ValueError, match="block ids"):
        model.prefill(kv, [1, 2], [4])
    with pytest.raises(ValueError, match="token ids"):
        model.prefill(kv, [model.config.vocab_size], [0])
    with pytest.raises(ValueError, match="shape"):
        model.prefill(kv[:, :, :, :, :1], [1], [0])
    with pytest.raises(ValueError, match="block table"):
        model.decode(kv, [1], [16], [[0]])
    with pytest.raises(ValueError):
        model.decode(kv, [1, 2], [0], [[0]])
    assert torch.isnan(kv).all()


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer(model):
    c = model.config
    assert kv_bytes_per_token(c, torch.float32) == 30 * 2 * 3 * 64 * 4
    assert kv_bytes_per_token(c, torch.bfloat16) == 30 * 2 * 3 * 64 * 2


def test_config_of_the_default_gguf(model, gguf_path):
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (1536, 49152, 8192)
    assert c.rope_theta == 100000.0 and c.tie_word_embeddings
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert load_config(gguf_path) == c  # the fast path reads the same config without the tensors


# -- loader ---------------------------------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_qk_permutation():
    n_head, head_dim, hidden = 3, 8, 5
    w = np.arange(n_head * head_dim * hidden, dtype=np.float32).reshape(n_head * head_dim, hidden)
    # convert_hf_to_gguf.py LlamaModel.permute
    permuted = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_gguf_qk(permuted, n_head), w)


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory, tok):
    """A random 2-layer Llama (llama3 RoPE scaling, untied head) saved like a Hub checkpoint."""
    d = tmp_path_factory.mktemp("tiny-llama")
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(d)
    tok.backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": tok.chat_template}))
    return d, hf


def test_hf_directory_loads_and_matches_the_hf_model(tiny_hf_dir, tok):
    d, hf = tiny_hf_dir
    config, weights = load_weights(d, progress=False)
    assert config.name == d.name and config.num_layers == 2 and config.head_dim == 16
    assert not config.tie_word_embeddings and "lm_head.weight" in weights
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "llama3"
    model = LlamaModel(config, weights)
    ids = tok.encode(tok.apply_chat_template(chat(PASSAGE[:400])))
    assert len(ids) > 64  # past original_max_position_embeddings, where llama3 scaling matters
    nb = blocks_for(len(ids) + 1)
    kv = make_pool(model, 2 * nb)
    table = scattered_blocks(nb, 2 * nb, seed=5)
    ours = model.prefill(kv, ids[:-1], table, all_logits=True)
    step = model.decode(kv, [ids[-1]], [len(ids) - 1], [table])[0]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref[:-1]).abs().max().item() < 1e-3
    assert (step - ref[-1]).abs().max().item() < 1e-3
    # The test is sensitive to the RoPE scaling: plain RoPE gives visibly different logits.
    plain = LlamaModel(ModelConfig(**{**config.__dict__, "rope_scaling": None}), weights)
    unscaled = plain.prefill(make_pool(plain, nb), ids, list(range(nb)), all_logits=True)
    assert (unscaled - ref).abs().max().item() > 1e-3


def test_hf_directory_tokenizer_matches_the_gguf_one(tiny_hf_dir, tok):
    d, _ = tiny_hf_dir
    t = Tokenizer.load(d)
    assert t.name == d.name and t.bos_token_id == 1 and t.eos_token_ids == (2,)
    for text in ["Hello 😀 world 123", "<|im_start|>user\nCafé<|im_end|>"]:
        assert t.encode(text) == tok.encode(text)
    assert t.apply_chat_template(chat("hi")) == tok.apply_chat_template(chat("hi"))


def test_unsupported_or_incomplete_models_are_named_in_the_error(tmp_path, tiny_hf_dir):
    with pytest.raises(ModelLoadError, match="no such"):
        load_weights(tmp_path / "missing.gguf")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2",
                                                      "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="gpt2"):
        load_weights(tmp_path)
    good, _ = tiny_hf_dir
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((good / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_weights(no_weights)
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="model.bin"):
        load_weights(tmp_path / "model.bin")


def test_a_gguf_of_another_architecture_is_refused(tmp_path):
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        load_weights(path, progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_model_on_cuda_matches_the_cpu_model(model, prompt_ids, gguf_path):
    config, weights = load_weights(gguf_path, progress=False)
    cuda = LlamaModel(config, weights, device="cuda")
    ids = prompt_ids["long"]
    nb = blocks_for(len(ids) + 8)
    table = scattered_blocks(nb, 2 * nb, seed=9)
    kv_cpu = make_pool(model, 2 * nb)
    kv_gpu = make_pool(model, 2 * nb).cuda()
    ref = model.prefill(kv_cpu, ids, table, all_logits=True)
    got = cuda.prefill(kv_gpu, ids, table, all_logits=True)
    assert (got.cpu() - ref).abs().max().item() < 1e-2  # TF32 / kernel differences, not layout bugs
    assert greedy(cuda, make_pool(model, 2 * nb).cuda(), ids, table, 8, stop=()) == \
        greedy(model, make_pool(model, 2 * nb), ids, table, 8, stop=())
