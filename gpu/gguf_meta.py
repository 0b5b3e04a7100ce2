"""GGUF metadata through the ``gguf`` package's ``GGUFReader`` (no tensor data is dequantized here).

``GGUFReader`` memory-maps the file and takes a few seconds on a 49k-token vocabulary; we read each file
once per process and keep the result (``functools.lru_cache``), so the supervisor, the API and each actor
pay it once. Values come from ``ReaderField.contents()``: scalars as int/float/bool/str, arrays as lists.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from pdserve.errors import ModelLoadError


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's header entry: ``shape`` in numpy order (llama.cpp's ``ne`` reversed) and ggml type id."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


@functools.lru_cache(maxsize=4)
def open_gguf(path: str):
    """A cached ``gguf.GGUFReader`` for ``path`` (read-only memory map).

    Raises:
        ModelLoadError: the file is missing, unreadable or not a GGUF file.
    """
    from gguf import GGUFReader

    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        return GGUFReader(path, "r")
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError/struct errors/OSError for damaged files
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def read_gguf_header(path: str | os.PathLike, *, tensors: bool = True
                     ) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
    """The key/value metadata and (when ``tensors``) the tensor directory of a GGUF file.

    Raises:
        ModelLoadError: as :func:`open_gguf`.
    """
    reader = open_gguf(os.fspath(path))
    meta = {key: field.contents() for key, field in reader.fields.items()}
    infos = [GGUFTensorInfo(t.name, tuple(int(n) for n in reversed(t.shape)), int(t.tensor_type),
                            int(t.data_offset)) for t in reader.tensors] if tensors else []
    return meta, infos


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Every key/value pair of a GGUF file's header (see :func:`read_gguf_header`)."""
    return read_gguf_header(path, tensors=False)[0]
