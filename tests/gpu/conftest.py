"""Shared fixtures for the model-layer tests: the default GGUF model, ours and Hugging Face's, loaded once.

Loading is the slow part (seconds each on a 2-core machine), so every fixture here is session-scoped and
the test modules share them.
"""
from __future__ import annotations

import pathlib

import pytest
import torch

from gpu.model import LlamaModel
from gpu.model_files import default_model_path
from gpu.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def gguf_path() -> pathlib.Path:
    return default_model_path()


@pytest.fixture(scope="session")
def tok(gguf_path) -> Tokenizer:
    return Tokenizer.load(gguf_path)


@pytest.fixture(scope="session")
def hf_tok(gguf_path):
    import transformers   # a declared test dependency: missing, the tests that need it fail (never skip)

    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def model(gguf_path) -> LlamaModel:
    return LlamaModel.from_path(gguf_path, progress=False)


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    m.eval()
    return m


def run_simulated_child(test_file, expected: int, timeout_s: float) -> str:
    """Run ``test_file``'s ``simulated`` tests in a child pytest under ``NUMBA_ENABLE_CUDASIM=1`` (the simulator must
    be on before numba is first imported, and then holds for the whole process) and check that all ``expected`` of
    them passed; returns the child's summary line."""
    import os
    import re
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "NUMBA_"))}
    env["NUMBA_ENABLE_CUDASIM"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "simulated",
                           "-o", "addopts=", str(test_file)], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    took = time.monotonic() - start
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"simulated tests failed (rc {proc.returncode}, {took:.0f}s):\n{tail}"
    summary = [line for line in proc.stdout.strip().splitlines() if " passed" in line][-1]
    assert re.match(rf"{expected} passed, \d+ deselected in ", summary), f"expected {expected} passed:\n{tail}"
    return f"{summary} ({took:.0f}s)"


IPC_GEOMETRY = dict(num_layers=3, num_blocks=16, block_tokens=4, num_kv_heads=2, head_dim=8)   # the IPC tests' pools


def finished(xfer, handle, timeout_s: float = 30.0):
    """The TransferStatus of ``handle`` once it left IN_PROGRESS (polled until the deadline)."""
    from ipc.kv_transport import TransferStatus
    from tests.conftest import wait_until

    return wait_until(lambda: xfer.poll(handle) != TransferStatus.IN_PROGRESS and xfer.poll(handle),
                      timeout_s, 0.001, "the KV copy")
