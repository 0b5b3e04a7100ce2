"""Embeddings as the prefill actor computes them (actors/model_runner.py ``prefill_forward`` with ``hidden`` chunks,
then ``pooled_embedding``) against Hugging Face's forward of the same weights (``AutoModel``'s
``last_hidden_state``, which is after the final norm, pooled the same way), and their batch invariance: the same
bits alone, chunked, and packed beside other prompts."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from actors.model_runner import embedding_to_wire, pooled_embedding, prefill_forward
from gpu.model import LlamaModel, kv_pool_shape

BLOCK_TOKENS = 16
TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Embeddings map a text to a vector; similar texts get nearby vectors, and a search compares them.",
         "Bonjour, comment ça va ? 😀"]


@pytest.fixture(scope="module")
def native_model(gguf_path) -> LlamaModel:
    return LlamaModel.from_path(gguf_path, progress=False, weights="auto")


def pool(model: LlamaModel, blocks: int) -> torch.Tensor:
    return torch.full(kv_pool_shape(model.config, blocks, BLOCK_TOKENS), float("nan"), dtype=model.dtype)


def embed(model: LlamaModel, ids: list[int], pooling: str, cuts: tuple[int, ...] = (), beside: list[int] = ()):
    """One prompt's embedding as the runner computes it: ``ids`` prefilled in the chunks ``cuts`` make (each a pass
    of its own), the first chunk packed after ``beside`` (another prompt, logits only); the hidden states of every
    chunk (mean) or of the last (last) pooled."""
    blocks = -(-len(ids) // BLOCK_TOKENS)
    extra = -(-len(beside) // BLOCK_TOKENS) if beside else 0
    kv = pool(model, blocks + extra)
    table, other = list(range(extra, extra + blocks)), list(range(extra))
    edges = [0, *cuts, len(ids)]
    assert edges == sorted(set(edges)), edges
    rows = []
    for n, (a, b) in enumerate(zip(edges, edges[1:])):
        hidden = pooling == "mean" or b == len(ids)
        chunks = [(ids, a, b, table, False, hidden)]
        if n == 0 and beside:
            chunks.insert(0, (list(beside), 0, len(beside), other, False))
        out = prefill_forward(model, kv, chunks)
        if hidden:
            rows.append(out[-1][0])
    assert all(r.shape == (b - a, model.config.hidden_size) and r.dtype == torch.float32
               for r, (a, b) in zip(rows, zip(edges, edges[1:])) if pooling == "mean")
    return pooled_embedding(torch.cat(rows), pooling)


def hf_embedding(hf_model, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.inference_mode():
        states = hf_model.model(torch.tensor([ids])).last_hidden_state[0].float()   # after the final norm
    return F.normalize(states[-1] if pooling == "last" else states.mean(0), dim=0)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_an_embedding_equals_hf_last_hidden_state_pooled_the_same_way(model, native_model, hf_model, tok, pooling):
    """float32 weights (the HF equality path) in one chunk and ``--weights auto`` (the engine's default: prefill on
    the float32 copies of the low-bit weights) in three: cosine >= 0.9999 with HF's, unit length."""
    for text in TEXTS[1:]:
        ids = tok.encode(text)
        ref = hf_embedding(hf_model, ids, pooling)
        for m, cuts in ((model, ()), (native_model, (len(ids) // 3, 2 * len(ids) // 3))):
            ours = embed(m, ids, pooling, cuts)
            assert ours.shape == ref.shape == (m.config.hidden_size,)
            assert abs(float(ours.norm()) - 1.0) < 1e-5
            cos = float(ours @ ref)
            assert cos >= 0.9999, (text, m.weights_mode, cuts, cos)   # measured: 1 - 3e-7 at worst


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_natively_an_embedding_is_the_same_bits_alone_chunked_and_packed_beside_another_prompt(native_model, tok,
                                                                                                pooling):
    """The project's batch invariance, for embeddings: the prefill batcher may cut a prompt into chunks and pack it
    with others (``--weights auto``)."""
    ids = tok.encode(TEXTS[1])
    alone = embed(native_model, ids, pooling)
    beside = tok.encode(TEXTS[0] + " " + TEXTS[2])
    runs = {"chunked": embed(native_model, ids, pooling, (7, 16)),
            "packed": embed(native_model, ids, pooling, beside=beside),
            "chunked and packed": embed(native_model, ids, pooling, (9,), beside=beside)}
    assert {name: torch.equal(v, alone) for name, v in runs.items()} == {name: True for name in runs}


def test_hidden_chunks_leave_the_logits_of_the_prompts_packed_beside_them_unchanged(native_model, tok):
    """A pass that packs an embedding's chunk gives the other prompts the logits they get without it."""
    ids, other = tok.encode(TEXTS[1]), tok.encode(TEXTS[0])
    kv = pool(native_model, 8)
    [(alone, _)] = prefill_forward(native_model, kv, [(other, 0, len(other), [0, 1], True)])
    kv = pool(native_model, 8)
    (logits, _), (hidden, _) = prefill_forward(native_model, kv, [(other, 0, len(other), [0, 1], True),
                                                                  (ids, 0, len(ids), [2, 3, 4], False, True)])
    assert torch.equal(logits, alone) and hidden.shape == (len(ids), native_model.config.hidden_size)


def test_the_wire_form_is_base64_of_little_endian_float32_and_the_pooling_is_checked():
    vector = torch.tensor([1.0, -0.5, 3.25e-8, float(np.float32(1 / 3))])
    raw = base64.b64decode(embedding_to_wire(vector))
    assert raw == np.asarray(vector.numpy(), dtype="<f4").tobytes()
    assert np.frombuffer(raw, "<f4").tolist() == vector.tolist()
    with pytest.raises(ValueError, match="pooling 'cls'"):
        pooled_embedding(torch.ones(2, 4), "cls")
