"""The engine on a GPU (marker ``gpu``; skipped without CUDA): ``pdserve serve --device cuda`` with a prefill and a
decode actor sharing one GPU, KV handed over through CUDA IPC, serving a tiny Llama (GQA) and a tiny DeepSeek-V2
(MLA) from Hugging Face directories. Greedy tokens equal Hugging Face's float32 ``generate`` on the CPU: exactly with
float32 weights, and with bf16 weights up to a first divergence the float32 model calls a near tie; a prefix-cache hit
and n=2 give the same answer; a stuck transfer is timed out by the watchdog with nothing left pinned.

Models: ``GPU_CHECK_MODELS`` (a directory that ``python -m tests.gpu.tiny_families DIR`` wrote:
tools/gpu_device_check.sh --prepare carries it to the device) or, where the embedded model is installed, built here.
``GPU_CHECK_DEVICE=cpu`` runs the same checks on the CPU path (a dry run of this module without a GPU).
"""
from __future__ import annotations

import os
import pathlib
import time

import httpx
import pytest
import torch

from tests.conftest import QUEUE_GAUGES, cleanup_engine, scrape, start_engine

DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]
NEW = 12
PROMPT = [(i * 7919) % 30000 + 200 for i in range(40)]  # token ids: 2 full blocks of 16 and 8 more
NEAR_TIE = 0.05   # a bf16 run may pick another token only where the float32 logits of the two differ by this


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> pathlib.Path:
    given = os.environ.get("GPU_CHECK_MODELS")
    if given:
        return pathlib.Path(given)
    from tests.gpu.tiny_families import GPU_CHECK_FAMILIES, save_bf16_hf_dir

    d = tmp_path_factory.mktemp("gpu-models")
    for family in GPU_CHECK_FAMILIES:
        save_bf16_hf_dir(family, d)
    return d


def reference(path: pathlib.Path, ids: list[int], n: int = NEW) -> tuple[list[int], torch.Tensor]:
    """Hugging Face's greedy tokens (float32, CPU) after ``ids``, and the float32 logits of each of those steps."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.inference_mode():
        x = torch.tensor([ids])
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, eos_token_id=None,
                          pad_token_id=2, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), torch.stack(out.logits)[:, 0]


def completion_texts(eng, body: dict) -> list[str]:
    r = httpx.post(eng.base_url + "/v1/completions", timeout=300, json={
        "prompt": PROMPT, "temperature": 0, "max_tokens": NEW, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return [c["text"] for c in r.json()["choices"]]


def serve(tmp_path_factory, path: pathlib.Path, *args: str, env: dict | None = None):
    return start_engine(tmp_path_factory.mktemp("gpu-engine"), "--model", str(path), "--device", DEVICE,
                        "--kv-pool-tokens", "1024", "--model-cache-dir", "off", *args, env=env)


@pytest.mark.parametrize("family", ["llama", "deepseek2"])
@pytest.mark.parametrize("weights,backend", [("float32", "torch"), ("bfloat16", "numba")])
def test_greedy_text_equals_hf_float32_with_a_cache_hit_and_n_2(models, tmp_path_factory, family, weights, backend):
    from gpu.tokenizer import Tokenizer

    if DEVICE == "cpu" and backend != "torch":
        pytest.skip("the dry run on the CPU: the numba kernels need the GPU")
    path = models / f"tiny-{family}"
    want, logits = reference(path, PROMPT)
    tok = Tokenizer.load(path)
    eng = serve(tmp_path_factory, path, "--weights", weights, "--attention-backend", backend)
    try:
        first, = completion_texts(eng, {})
        again, = completion_texts(eng, {})
        two = completion_texts(eng, {"n": 2})
    finally:
        cleanup_engine(eng)
    assert again == first and two == [first, first], "a cache hit or a second choice changed the answer"
    if weights == "float32" or first == tok.decode(want):
        assert first == tok.decode(want)
        return
    # bf16: the first step whose float32 token the engine did not write must be a near tie of the float32 model
    same = max(k for k in range(NEW + 1) if first.startswith(tok.decode(want[:k])))
    top2 = logits[same].topk(2).values
    margin = float(top2[0] - top2[1])
    assert margin <= NEAR_TIE, (f"the text diverges at token {same} of {NEW} ({first!r} vs {tok.decode(want)!r}) "
                                f"where float32's top two differ by {margin:.3f}: not a bf16 near tie")


def test_a_stuck_transfer_times_out_and_leaves_nothing_pinned(models, tmp_path_factory):
    tick_s, inflight_s = 0.5, 2.0
    eng = serve(tmp_path_factory, models / "tiny-llama", "--weights", "bfloat16", env={
        "PDSERVE_FAULTS": "transfer_stuck:match=stuck-", "PDSERVE_INFLIGHT_TIMEOUT_S": str(inflight_s),
        "PDSERVE_MONITOR_TICK_S": str(tick_s)})
    try:
        start = time.monotonic()
        r = httpx.post(eng.base_url + "/v1/completions", headers={"X-Request-Id": "stuck-gpu-1"}, timeout=60,
                       json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        took = time.monotonic() - start
        assert r.status_code == 504 and "stage transfer" in r.json()["error"]["message"], r.text
        assert took < inflight_s + tick_s + 5.0, f"answered after {took:.1f} s"
        gauges = scrape(eng.base_url)
        assert {name: gauges[name] for name in QUEUE_GAUGES} == dict.fromkeys(QUEUE_GAUGES, 0.0)
        ok = httpx.post(eng.base_url + "/v1/completions", timeout=60,
                        json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200, ok.text
    finally:
        cleanup_engine(eng)
