"""The prepared-model cache: a model built once (read, dequantized or packed, Q/K unpermuted, QKV fused) is
saved to one file that every later process memory-maps read-only instead of reading the model file again.

One file per (model file path, size, mtime, weights mode, torch version, format version), named by a hash of
that key under the cache directory (default ``~/.cache/pdserve/models``). It is ``torch.save`` output holding
``{"key": str, "meta": str, "tensors": {name: tensor}}`` (``LlamaModel.to_state``), written to a temporary
file and renamed into place, so a reader sees a whole file or none. ``torch.load(mmap=True, weights_only=True)``
maps it: the actors of one engine share the file's page-cache pages and nothing is copied or dequantized at
start-up. A file that cannot be read (truncated, corrupt, from another key) is rebuilt, never trusted.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
from typing import Any

import torch

from .loader import resolve_model_path
from .model_files import default_cache_dir

log = logging.getLogger("pdserve.prepared")

__all__ = ["FORMAT_VERSION", "cache_path", "default_cache_dir", "ensure_prepared", "load_prepared",
           "prepared_key", "prepared_model", "save_prepared"]

# bump when LlamaModel.to_state's layout changes (5: K-quant/Q5 GGUF linears kept low-bit, the "int8h" kind;
# 6: native untied dense heads as int8 too)
FORMAT_VERSION = 6


def prepared_key(model_path: str | os.PathLike | None, weights: str) -> str:
    """The cache key (JSON text) of a model file or HF directory in a resolved weights mode (``"native"``,
    ``"float32"``, ``"bfloat16"``; ``gpu.model.resolve_weights_mode``): resolved path, and the size
    and mtime (ns) of every file it is read from, the mode, torch's version and :data:`FORMAT_VERSION`.

    Raises:
        ModelLoadError: the model path does not exist (see ``gpu.loader.resolve_model_path``).
    """
    p = resolve_model_path(model_path).resolve()
    files = sorted([*p.glob("*.safetensors"), p / "config.json"]) if p.is_dir() else [p]
    stats = [[f.name, st.st_size, st.st_mtime_ns] for f in files if f.exists() for st in [f.stat()]]
    return json.dumps({"format": FORMAT_VERSION, "model": str(p), "files": stats, "weights": weights,
                       "torch": torch.__version__}, sort_keys=True)


def cache_path(cache_dir: str | os.PathLike, key: str) -> pathlib.Path:
    """``<cache_dir>/<model file stem>-<weights>-<16 hex digits of sha256(key)>.pt``."""
    k = json.loads(key)
    stem = pathlib.Path(k["model"]).name.removesuffix(".gguf")
    return pathlib.Path(cache_dir) / f"{stem}-{k['weights']}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def save_prepared(model, path: pathlib.Path, key: str) -> None:
    """Write ``model`` (a ``gpu.model.LlamaModel``) to ``path`` atomically (temporary file + rename).

    Raises:
        OSError: the directory cannot be created or written.
    """
    from gpu.model_files import write_atomically

    meta, tensors = model.to_state()
    write_atomically(path, lambda f: torch.save({"key": key, "meta": json.dumps(meta), "tensors": tensors}, f))


def _read(path: pathlib.Path, key: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """``(meta, tensors)`` memory-mapped from ``path``, or None when it is missing, unreadable or for another
    key."""
    if not path.is_file():
        return None
    try:
        blob = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        if not isinstance(blob, dict) or blob.get("key") != key:
            log.warning("prepared model %s is for another model or version; rebuilding it", path)
            return None
        return json.loads(blob["meta"]), blob["tensors"]
    except Exception as exc:  # noqa: BLE001 - a damaged file raises anything from zipfile to pickle errors
        log.warning("prepared model %s is unreadable (%s: %s); rebuilding it", path, type(exc).__name__, exc)
        return None


def load_prepared(path: pathlib.Path, key: str, device: str = "cpu"):
    """The ``LlamaModel`` saved at ``path`` for ``key``, its weights memory-mapped; None if the file is missing,
    damaged or stale (a warning says which)."""
    from .model import LlamaModel

    found = _read(path, key)
    if found is None:
        return None
    try:
        return LlamaModel.from_state(*found, device=device)
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        log.warning("prepared model %s does not rebuild (%s: %s); rebuilding it", path, type(exc).__name__, exc)
        return None


def prepared_model(model_path: str | os.PathLike | None, weights: str, device: str = "cpu",
                   cache_dir: str | os.PathLike | None = None, progress: bool = False):
    """A ``gpu.model.LlamaModel`` for ``model_path`` in ``weights`` mode (``"auto"``, ``"float32"``,
    ``"bfloat16"``): from the cache when it holds a valid file, else built from the model file and saved.
    ``cache_dir`` None = :func:`default_cache_dir`; ``"off"`` = no cache (always build).

    Raises:
        ModelLoadError: the model file is missing or unsupported.
        ValueError: an unknown weights mode.
    """
    from .model import LlamaModel, resolve_weights_mode

    if cache_dir == "off":
        return LlamaModel.from_path(model_path, device=device, progress=progress, weights=weights)
    key = prepared_key(model_path, resolve_weights_mode(weights, device))
    path = cache_path(cache_dir or default_cache_dir(), key)
    model = load_prepared(path, key, device)
    if model is not None:
        return model
    model = LlamaModel.from_path(model_path, device=device, progress=progress, weights=weights)
    try:
        save_prepared(model, path, key)
        log.info("prepared model saved to %s", path)
    except OSError as exc:  # a read-only or full cache directory costs start-up time, not the engine
        log.warning("cannot save the prepared model to %s (%s); every start will read the model file", path, exc)
    return model


def ensure_prepared(model_path: str | os.PathLike | None, weights: str, device: str = "cpu",
                    cache_dir: str | os.PathLike | None = None) -> pathlib.Path | None:
    """Make sure the cache holds a valid prepared file (building it if not) and return its path; None when
    ``cache_dir`` is ``"off"``. The supervisor calls this once before it spawns the actors, so they only map it.

    Raises:
        ModelLoadError, ValueError: as :func:`prepared_model`.
    """
    from .model import resolve_weights_mode

    if cache_dir == "off":
        return None
    key = prepared_key(model_path, resolve_weights_mode(weights, device))
    path = cache_path(cache_dir or default_cache_dir(), key)
    if _read(path, key) is None:
        prepared_model(model_path, weights, device, cache_dir)
    return path

