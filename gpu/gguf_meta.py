"""GGUF metadata through the ``gguf`` package's ``GGUFReader`` (no tensor data is dequantized here).

``GGUFReader`` memory-maps the file and takes 3-4 s on a 49k-token vocabulary (it builds a numpy view per
array element); we read each file once per process and keep the result (``functools.lru_cache``). With a
``cache_dir`` (the engine's model cache) the header is also kept across processes and runs: a JSON file
``<cache_dir>/<file stem>-header-<16 hex digits of sha256(key)>.json`` holding ``{"key", "meta", "tensors"}``,
the key being (resolved path, size, mtime in ns, the ``gguf`` package's version, :data:`HEADER_FORMAT_VERSION`),
written to a temporary file and renamed into place. A cache file that does not parse or
carries another key is logged and rewritten, never trusted. Values come from ``ReaderField.contents()``: scalars
as int/float/bool/str, arrays as lists; all survive JSON unchanged.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
from dataclasses import dataclass
from typing import Any

from pdserve.errors import ModelLoadError

log = logging.getLogger("pdserve.gguf_meta")

HEADER_FORMAT_VERSION = 1   # bump when the cached header's JSON layout changes


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


def read_gguf_header(path: str | os.PathLike, *, tensors: bool = True,
                     cache_dir: str | os.PathLike | None = None) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
    """The key/value metadata and (when ``tensors``) the tensor directory of a GGUF file.

    ``cache_dir``: the model cache (``gpu.model_files.model_cache_dir``) to read the header from, and to save it
    to after reading the file; None = read the file (once per process).

    Raises:
        ModelLoadError: as :func:`open_gguf`.
    """
    if cache_dir is not None:
        meta, infos = _cached_header(pathlib.Path(path), pathlib.Path(cache_dir))
        return meta, infos if tensors else []
    reader = open_gguf(os.fspath(path))
    meta = {key: field.contents() for key, field in reader.fields.items()}
    infos = [GGUFTensorInfo(t.name, tuple(int(n) for n in reversed(t.shape)), int(t.tensor_type),
                            int(t.data_offset)) for t in reader.tensors] if tensors else []
    return meta, infos


def read_gguf_metadata(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Every key/value pair of a GGUF file's header (see :func:`read_gguf_header`)."""
    return read_gguf_header(path, tensors=False, cache_dir=cache_dir)[0]


def header_cache_path(path: str | os.PathLike, cache_dir: str | os.PathLike) -> tuple[pathlib.Path, str]:
    """``(cache file, key)`` of a GGUF file's header in ``cache_dir`` (see the module docstring).

    Raises:
        ModelLoadError: the GGUF file does not exist.
    """
    p = pathlib.Path(path).expanduser().resolve()
    try:
        st = p.stat()
    except OSError:
        raise ModelLoadError(f"{p}: no such GGUF file") from None
    key = json.dumps({"format": HEADER_FORMAT_VERSION, "model": str(p), "size": st.st_size,
                      "mtime_ns": st.st_mtime_ns, "gguf": importlib.metadata.version("gguf")}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return pathlib.Path(cache_dir) / f"{p.name.removesuffix('.gguf')}-header-{digest}.json", key


def _cached_header(path: pathlib.Path, cache_dir: pathlib.Path) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
    cache_file, key = header_cache_path(path, cache_dir)
    found = _read_cached(cache_file, key)
    if found is not None:
        return found
    meta, infos = read_gguf_header(path)
    blob = {"key": key, "meta": meta, "tensors": [[t.name, list(t.shape), t.ggml_type, t.offset] for t in infos]}
    try:
        _write_atomically(cache_file, json.dumps(blob).encode())
        log.info("GGUF header of %s saved to %s", path, cache_file)
    except OSError as exc:   # a read-only or full cache directory costs start-up time, not the engine
        log.warning("cannot save the GGUF header to %s (%s); every start will read %s", cache_file, exc, path)
    return meta, infos


def _read_cached(cache_file: pathlib.Path, key: str) -> tuple[dict[str, Any], list[GGUFTensorInfo]] | None:
    """The header saved in ``cache_file`` for ``key``; None when missing, unreadable or for another key."""
    try:
        with open(cache_file, "rb") as f:
            blob = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:   # ValueError: truncated or corrupt JSON, bad UTF-8
        log.warning("cached GGUF header %s is unreadable (%s); rebuilding it", cache_file, exc)
        return None
    try:
        if blob["key"] != key:
            log.warning("cached GGUF header %s is for another file or version; rebuilding it", cache_file)
            return None
        infos = [GGUFTensorInfo(str(n), tuple(int(d) for d in shape), int(ty), int(off))
                 for n, shape, ty, off in blob["tensors"]]
        meta = blob["meta"]
        if not isinstance(meta, dict):
            raise TypeError(f"meta is a {type(meta).__name__}")
        return meta, infos
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("cached GGUF header %s is malformed (%s: %s); rebuilding it", cache_file,
                    type(exc).__name__, exc)
        return None


def _write_atomically(target: pathlib.Path, data: bytes) -> None:
    from gpu.model_files import write_atomically

    write_atomically(target, lambda f: f.write(data))
