"""The KV reservation formula, written once: what a sequence reserves in a decode pool.

| name         | what                                                                   |
|--------------|------------------------------------------------------------------------|
| `blocks_for` | blocks for prompt + max_tokens tokens (api/admission.py, api/protocol.py, actors/decode_core.py) |
"""
from __future__ import annotations


def blocks_for(prompt_tokens: int, max_tokens: int, block_tokens: int) -> int:
    """KV blocks one sequence of ``prompt_tokens`` prompt tokens reserves to generate up to ``max_tokens``:
    ``ceil((prompt_tokens + max_tokens) / block_tokens)``. Raises ValueError for ``block_tokens <= 0``."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    return -(-(prompt_tokens + max_tokens) // block_tokens)
