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
