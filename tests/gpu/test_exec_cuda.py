"""The CUDA executor (gpu/exec_cuda.py) with the numba kernels wired into a tiny model: prefill and greedy decode give
the torch path's tokens, for each attention kind (GQA: Llama; MLA: DeepSeek-V2, decoded as MQA over the latent).

The kernels run under numba's CUDA simulator on CPU tensors, which must be switched on before numba is first
imported, so the ``simulated`` tests run in a child pytest (``NUMBA_ENABLE_CUDASIM=1 -k simulated``, as
tests/gpu/test_kernels_cudasim.py does); in the parent they are skipped and the child's summary is checked. Sizes are
tiny (2 layers, hidden 64, 4 heads, a 256-token vocabulary, blocks of 4 tokens): every simulated CUDA thread is a
Python thread. The ``cuda`` variants run the same on a GPU (marker ``gpu``).
"""
from __future__ import annotations

import os
import pathlib

import pytest
import torch

from gpu.model import LlamaModel, kv_pool_shape, resolve_executor
from tests.gpu.conftest import run_simulated_child

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
GPU = not SIM and torch.cuda.is_available()
HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parents[2]
VOCAB = 256
BLOCK = 4
DECODE_STEPS = 4
KINDS = ["llama", "deepseek2"]   # GQA and MLA
DEVICES = [
    pytest.param("simulated", marks=pytest.mark.skipif(
        not SIM, reason="simulated in the NUMBA_ENABLE_CUDASIM=1 child of "
                        "test_the_cuda_executor_passes_under_the_cuda_simulator")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs a CUDA device")]),
]


@pytest.fixture(params=DEVICES)
def dev(request) -> str:
    return "cpu" if request.param == "simulated" else "cuda"


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    """HF directories of 2-layer random models of each attention kind (tests/gpu/tiny_families.py's configs with
    2 layers and a 256-token vocabulary; DeepSeek-V2's layer 1 is sparse)."""
    import transformers

    from tests.gpu.tiny_families import hf_config

    dirs = {}
    for name in KINDS:
        cfg = hf_config(name, vocab_size=VOCAB)
        cfg.num_hidden_layers = 2
        torch.manual_seed(3)
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for pname, p in hf.named_parameters():
                p.copy_(torch.randn_like(p) * 0.2 + 1.0 if "norm" in pname else torch.randn_like(p) * 0.15)
        d = tmp_path_factory.mktemp(name)
        hf.save_pretrained(str(d))
        dirs[name] = d
    return dirs


def greedy(model: LlamaModel, prompts: list[list[int]], steps: int,
           forced: list[list[int]] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill ``prompts`` packed, then ``steps`` batched greedy decode steps: each row's tokens (the first from its
    prefill) and every step's logits ``[B, vocab]`` (the prefill's first). ``forced``: feed these rows' tokens
    instead of the model's own (teacher forcing), so two models' steps see the same inputs."""
    c = model.config
    kv = torch.zeros(kv_pool_shape(c, 24, BLOCK), dtype=model.dtype, device=model.device)
    tables = [[9, 2, 17, 5, 11], [3, 20, 7, 14, 1]]   # scattered, disjoint
    logits = [torch.stack(model.prefill_packed(kv, prompts, tables, [0, 0]))]
    tokens = [[int(lg.argmax())] for lg in logits[0]]
    for s in range(steps):
        positions = [len(p) + s for p in prompts]
        feed = [t[s] for t in forced] if forced else [t[-1] for t in tokens]
        logits.append(model.decode(kv, feed, positions, tables))
        for row, lg in zip(tokens, logits[-1]):
            row.append(int(lg.argmax()))
    return tokens, logits


def count_calls(monkeypatch, module, name: str) -> list:
    """Replace ``module.name`` by a wrapper that records each call's first argument's shape; the list it fills."""
    calls, real = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def assert_steps_close(got_logits: list, want_logits: list, tol: float) -> None:
    """Every step's logits within ``tol``, and the same argmax wherever the reference's top two are further apart
    than twice that (a near tie may fall either way)."""
    for step, (a, b) in enumerate(zip(got_logits, want_logits)):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=tol, msg=f"step {step}")
        top2 = b.float().topk(2, dim=-1).values  # [B, 2]
        clear = top2[:, 0] - top2[:, 1] > 2 * tol
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear]), step


PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [11, 200, 13, 6, 77, 190, 31, 8, 64, 2, 128]]   # 7 and 11: ragged rows


# float32: the CPU path's dtype (logits within float32 rounding); bfloat16: the engine's on a GPU (the kernel's
# float32 math against SDPA's bf16: within a few bf16 steps of logits of magnitude ~10)
DTYPES = {torch.float32: 1e-4, torch.bfloat16: 0.15}


@pytest.mark.parametrize("dtype", list(DTYPES), ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", KINDS)
def test_the_numba_kernels_decode_the_torch_paths_greedy_tokens(dev, tiny_dirs, name, dtype, monkeypatch):
    """float32: the same greedy tokens, free-running. bfloat16: teacher-forced on the torch path's tokens, every
    step's logits within bf16 rounding and the same argmax wherever the torch path's top two are further apart
    than that (a near tie may fall either way in bf16, as on the GPU)."""
    from gpu import exec_cuda

    launches = count_calls(monkeypatch, exec_cuda, "paged_attention_decode")
    ref = LlamaModel.from_path(tiny_dirs[name], device=dev, progress=False, dtype=dtype)
    ours = LlamaModel.from_path(tiny_dirs[name], device=dev, progress=False, dtype=dtype, executor="cuda",
                                executor_options={"attention_backend": "numba"})
    assert type(ref.executor).__name__ == ("MLATorchExecutor" if name == "deepseek2" else "TorchExecutor")
    assert type(ours.executor).__name__ == ("MLACudaExecutor" if name == "deepseek2" else "CudaExecutor")
    assert ours.executor.kernel_layers == [0, 1] and ours.dtype == dtype
    tol = DTYPES[dtype]
    want, want_logits = greedy(ref, PROMPTS, DECODE_STEPS)
    got, got_logits = greedy(ours, PROMPTS, DECODE_STEPS, forced=None if dtype == torch.float32 else want)
    assert len(launches) == DECODE_STEPS * 2   # one per layer and step (MLA: its 4 heads fit one launch)
    if dtype == torch.float32:
        assert got == want
    assert_steps_close(got_logits, want_logits, tol)


def test_the_tensor_core_attention_decodes_the_torch_paths_bf16_tokens(dev, tiny_dirs, monkeypatch):
    """``attention_backend="mma"`` (gpu/kernels/mma_attention.py: QK^T and PV as mma.sync tiles, P in bf16): the
    tiny Llama in bf16, teacher-forced on the torch path's tokens, every step's logits within bf16 rounding and the
    same argmax wherever the torch path's top two are further apart than that."""
    from gpu import exec_cuda

    launches = count_calls(monkeypatch, exec_cuda, "mma_attention_decode")
    ref = LlamaModel.from_path(tiny_dirs["llama"], device=dev, progress=False, dtype=torch.bfloat16)
    ours = LlamaModel.from_path(tiny_dirs["llama"], device=dev, progress=False, dtype=torch.bfloat16,
                                executor="cuda", executor_options={"attention_backend": "mma"})
    assert ours.executor.kernel_layers == [0, 1]
    tol = DTYPES[torch.bfloat16]
    want, want_logits = greedy(ref, PROMPTS, DECODE_STEPS)
    _, got_logits = greedy(ours, PROMPTS, DECODE_STEPS, forced=want)
    assert len(launches) == DECODE_STEPS * 2   # one per layer and step
    assert_steps_close(got_logits, want_logits, tol)


def test_the_numba_linear_backend_gives_the_torch_linears_tokens(dev, tiny_dirs, monkeypatch):
    """``linear_backend``: a function ``(x, w) -> x @ w.T`` that every dense linear (prefill and decode, the LM head
    too) goes through, here the numba tiled kernel (``LINEAR_BACKENDS["numba"]``) with tiles of 64 outputs (the
    simulator's default 8-wide tiles take minutes over the 256-token head)."""
    from gpu import exec_cuda

    calls = []

    def tiled(x, w):
        calls.append(w.shape)
        return exec_cuda.LINEAR_BACKENDS["numba"](x, w, tiles=None if dev == "cuda" else (16, 64, 16, 4, 8))

    ref = LlamaModel.from_path(tiny_dirs["llama"], device=dev, progress=False)
    ours = LlamaModel.from_path(tiny_dirs["llama"], device=dev, progress=False, executor="cuda",
                                executor_options={"attention_backend": "torch", "linear_backend": tiled})
    assert ours.executor.kernel_layers == [] and ours.executor.linear_fn is tiled
    prompts = [p[:5] for p in PROMPTS]
    want, want_logits = greedy(ref, prompts, 1)
    got, got_logits = greedy(ours, prompts, 1)
    assert got == want
    assert len(calls) == 2 * (2 * 4 + 1)   # prefill and one decode step: 4 linears a layer, then the head
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)


def test_the_execution_path_is_chosen_once_by_name():
    assert resolve_executor("auto", native=True) == "lowbit" and resolve_executor("auto", native=False) == "torch"
    assert resolve_executor("cuda", native=False) == "cuda"
    with pytest.raises(ValueError, match="executor 'gpu'"):
        resolve_executor("gpu", native=False)
    with pytest.raises(ValueError, match="lowbit path runs native weights"):
        resolve_executor("cuda", native=True)


@pytest.mark.skipif(SIM or GPU, reason="what the cuda path says on a machine without a device or the simulator")
def test_the_cuda_path_refuses_a_machine_without_a_device(tiny_dirs):
    with pytest.raises(RuntimeError, match="need a CUDA device"):
        LlamaModel.from_path(tiny_dirs["llama"], progress=False, executor="cuda")
    with pytest.raises(ValueError, match="runs on a CUDA device; the model is on cpu"):
        LlamaModel.from_path(tiny_dirs["llama"], progress=False, executor="cuda",
                             executor_options={"attention_backend": "torch"})
    with pytest.raises(ValueError, match="attention_backend 'flash'"):
        LlamaModel.from_path(tiny_dirs["llama"], progress=False, executor="cuda",
                             executor_options={"attention_backend": "flash"})
    with pytest.raises(ValueError, match="are for the cuda path"):
        LlamaModel.from_path(tiny_dirs["llama"], progress=False, executor_options={"attention_backend": "torch"})


def simulated_cases() -> int:
    """How many ``simulated`` tests this file holds (the child must pass them all)."""
    return len(KINDS) * len(DTYPES) + 2   # the kinds x dtypes, the tensor-core attention, the numba linear


@pytest.mark.timeout(400)
def test_the_cuda_executor_passes_under_the_cuda_simulator():
    if SIM:
        pytest.skip("this is the simulator child")
    print(run_simulated_child(HERE, simulated_cases(), timeout_s=380))
