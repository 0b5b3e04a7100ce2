"""Other model families end to end (prefill -> KV handoff -> decode): a tiny random-weight Gemma 3 served from a
Hugging Face directory, a tiny Qwen2 and a tiny Qwen3-MoE served from GGUFs, a tiny DeepSeek-V3 from a ``deepseek2``
GGUF (MLA with a compressed query and sigmoid routing: latent KV blocks through the cpu-shm handoff and the prefix
cache; DeepSeek-V2's model from HF directories is compared with HF in tests/gpu) (tests/gpu/tiny_families.py; all
carry the embedded SmolLM2 tokenizer and chat template). The engine's greedy answers equal HF ``generate``'s tokens:
a chat request (the template from the model files), a repeated prompt answered from the prefix cache
(``cached_tokens`` > 0) and n=2. One engine per family, module-scoped."""
from __future__ import annotations

import httpx
import pytest
import torch

from gpu.tokenizer import Tokenizer
from tests.conftest import cleanup_engine, start_engine
from tests.gpu.tiny_families import build_hf, write_gguf

NEW = 12
PROMPT = [(i * 7919) % 30000 + 200 for i in range(40)]  # token ids: 2 full blocks of 16 and 8 more


@pytest.fixture(scope="module", params=[("gemma3", "hf"), ("qwen2", "gguf"), ("qwen3_moe", "gguf"),
                                        ("deepseek3", "gguf")],
                ids=lambda p: "-".join(p))
def served(request, tmp_path_factory):
    """(engine, HF model, our tokenizer of the served files)."""
    import transformers

    from gpu.model_files import default_model_path

    name, form = request.param
    d = tmp_path_factory.mktemp(name)
    hf = build_hf(name)
    if form == "hf":
        smol = default_model_path()
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(smol.parent), gguf_file=smol.name)
        hf.save_pretrained(str(d / f"tiny-{name}"))
        hf_tok.save_pretrained(str(d / f"tiny-{name}"))
        path = d / f"tiny-{name}"
    else:
        path = write_gguf(name, hf, d / f"tiny-{name}.gguf")
    eng = start_engine(d, "--model", str(path), "--kv-pool-tokens", "1024", "--model-cache-dir", "off",
                       "--weights", "float32")   # HF equality: the dense path
    try:
        yield eng, hf, Tokenizer.load(path)
    finally:
        cleanup_engine(eng)


def hf_greedy(hf, ids: list[int], n: int = NEW) -> list[int]:
    with torch.inference_mode():
        x = torch.tensor([ids])
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                          eos_token_id=None, pad_token_id=2)
    return out[0, len(ids):].tolist()


def post(eng, route: str, body: dict) -> dict:
    r = httpx.post(eng.base_url + route, json={"temperature": 0, "max_tokens": NEW, "ignore_eos": True, **body},
                   timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_answers_equal_hf_generate_with_a_prefix_cache_hit_and_n_2(served):
    eng, hf, tok = served
    want = tok.decode(hf_greedy(hf, PROMPT))
    first = post(eng, "/v1/completions", {"prompt": PROMPT})
    again = post(eng, "/v1/completions", {"prompt": PROMPT})
    assert first["choices"][0]["text"] == want
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again["usage"]
    assert again["choices"][0]["text"] == want
    two = post(eng, "/v1/completions", {"prompt": PROMPT, "n": 2})
    assert [c["text"] for c in two["choices"]] == [want, want]


def test_a_chat_answer_uses_the_model_files_template_and_equals_hf(served):
    eng, hf, tok = served
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.chat_template
    ids = tok.encode(tok.apply_chat_template(messages))
    body = post(eng, "/v1/chat/completions", {"messages": messages})
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["message"]["content"] == tok.decode(hf_greedy(hf, ids))
