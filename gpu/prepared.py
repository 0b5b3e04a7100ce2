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
from typing import TYPE_CHECKING, Any

from .loader import resolve_model_path
from .model_files import default_cache_dir, resolve_weights_mode

if TYPE_CHECKING:   # annotations only: the supervisor names the file (prepared_file) without importing torch
    import torch

log = logging.getLogger("pdserve.prepared")

__all__ = ["FORMAT_VERSION", "cache_path", "default_cache_dir", "ensure_prepared", "load_prepared",
           "model_from_state", "model_state", "prepared_file", "prepared_key", "prepared_model", "save_prepared",
           "torch_version"]

# bump when LlamaModel.to_state's layout changes (5: K-quant/Q5 GGUF linears kept low-bit, the "int8h" kind;
# 6: native untied dense heads as int8 too; 7: Q5_0/Q5_1/Q5_K linears on the Q5 tiles, the "int5" kind)
FORMAT_VERSION = 7


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
                       "torch": torch_version()}, sort_keys=True)


def torch_version() -> str:
    """The installed torch's version (``torch.__version__``, read from its metadata without importing it)."""
    import importlib.metadata

    return importlib.metadata.version("torch")


def prepared_file(model_path: str | os.PathLike | None, weights: str, device: str = "cpu",
                  cache_dir: str | os.PathLike | None = None) -> pathlib.Path | None:
    """The cache's file for the model in ``weights`` mode when one is there (not read: the loading process checks
    its key and rebuilds a damaged one), else None; None too when ``cache_dir`` is ``"off"``. Needs no torch (the
    supervisor's warm start; :func:`ensure_prepared` builds a missing file).

    Raises:
        ModelLoadError, ValueError: as :func:`prepared_key` and ``resolve_weights_mode``.
    """
    if cache_dir == "off":
        return None
    path = cache_path(cache_dir or default_cache_dir(), prepared_key(model_path, resolve_weights_mode(weights,
                                                                                                     device)))
    return path if path.is_file() else None


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
    import torch

    from gpu.model_files import write_atomically

    meta, tensors = model.to_state()
    write_atomically(path, lambda f: torch.save({"key": key, "meta": json.dumps(meta), "tensors": tensors}, f))


def _read(path: pathlib.Path, key: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """``(meta, tensors)`` memory-mapped from ``path``, or None when it is missing, unreadable or for another
    key."""
    import torch

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


def load_prepared(path: pathlib.Path, key: str, device: str = "cpu", executor: str = "auto",
                  executor_options: dict[str, Any] | None = None):
    """The ``LlamaModel`` saved at ``path`` for ``key``, its weights memory-mapped, on the ``executor`` path; None
    if the file is missing, damaged or stale (a warning says which)."""
    found = _read(path, key)
    if found is None:
        return None
    try:
        return model_from_state(*found, device, executor, executor_options)
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        log.warning("prepared model %s does not rebuild (%s: %s); rebuilding it", path, type(exc).__name__, exc)
        return None


def prepared_model(model_path: str | os.PathLike | None, weights: str, device: str = "cpu",
                   cache_dir: str | os.PathLike | None = None, progress: bool = False, executor: str = "auto",
                   executor_options: dict[str, Any] | None = None):
    """A ``gpu.model.LlamaModel`` for ``model_path`` in ``weights`` mode (``"auto"``, ``"float32"``,
    ``"bfloat16"``): from the cache when it holds a valid file, else built from the model file and saved.
    ``cache_dir`` None = :func:`default_cache_dir`; ``"off"`` = no cache (always build). ``executor`` and
    ``executor_options``: the path it runs on (``gpu.model.resolve_executor``; ``"cuda"`` and its knobs,
    gpu/exec_cuda.py).

    Raises:
        ModelLoadError: the model file is missing or unsupported.
        ValueError: an unknown weights mode.
    """
    from .model import LlamaModel

    on = {"executor": executor, "executor_options": executor_options}
    if cache_dir == "off":
        return LlamaModel.from_path(model_path, device=device, progress=progress, weights=weights, **on)
    key = prepared_key(model_path, resolve_weights_mode(weights, device))
    path = cache_path(cache_dir or default_cache_dir(), key)
    model = load_prepared(path, key, device, **on)
    if model is not None:
        return model
    model = LlamaModel.from_path(model_path, device=device, progress=progress, weights=weights, **on)
    try:
        save_prepared(model, path, key)
        log.info("prepared model saved to %s", path)
    except OSError as exc:  # a read-only or full cache directory costs start-up time, not the engine
        log.warning("cannot save the prepared model to %s (%s); every start will read the model file", path, exc)
    return model


def ensure_prepared(model_path: str | os.PathLike | None, weights: str, device: str = "cpu",
                    cache_dir: str | os.PathLike | None = None) -> pathlib.Path | None:
    """Make sure the cache holds a valid prepared file (building it if not) and return its path; None when
    ``cache_dir`` is ``"off"``. The supervisor calls this before it spawns the actors when :func:`prepared_file`
    finds no file, so they only map it.

    Raises:
        ModelLoadError, ValueError: as :func:`prepared_model`.
    """
    if cache_dir == "off":
        return None
    key = prepared_key(model_path, resolve_weights_mode(weights, device))
    path = cache_path(cache_dir or default_cache_dir(), key)
    if _read(path, key) is None:
        prepared_model(model_path, weights, device, cache_dir)
    return path



# -- the built model as flat tensors (LlamaModel.to_state / from_state) ----------------------------------------------

_LINEARS = ("qkv", "o", "gate_up", "down")


def model_state(model) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``model`` (a ``gpu.model.LlamaModel`` or ``gpu.mla.MLAModel``) as ``(meta, tensors)``: JSON-able ``meta``
    (config, mode, each linear's kind and output size; ``"attention": "mla"`` for MLA) and flat CPU ``tensors``
    (packed weights as they run), so :func:`model_from_state` rebuilds it without the model file."""
    import dataclasses  # noqa: PLC0415

    tensors, kinds, outputs, put = _state_writer(model)
    mla = model.config.spec.attention == "mla"
    for i, layer in enumerate(model.layers):
        (_mla_layer_state if mla else _layer_state)(f"layers.{i}.", layer, tensors, put)
    meta = {"config": dataclasses.asdict(model.config), "native": model.native,
            "dtype": str(model.dtype).removeprefix("torch."), "kinds": kinds, "out_features": outputs}
    if mla:
        meta["attention"] = "mla"
    return meta, tensors


def _layer_state(p: str, layer, tensors: dict[str, torch.Tensor], put) -> None:
    """A GQA layer's tensors under prefix ``p`` (norms, family extras, linears, router and experts)."""
    from .layers import Layer  # noqa: PLC0415

    tensors[p + "ln_attn"], tensors[p + "ln_mlp"] = layer.ln_attn, layer.ln_mlp
    tensors.update({p + e: getattr(layer, e) for e in Layer.EXTRAS if getattr(layer, e) is not None})
    for name in _LINEARS:
        if getattr(layer, name) is not None:
            put(p + name, getattr(layer, name))
    if layer.router is not None:
        tensors[p + "router"] = layer.router
        for e, (gu, dn) in enumerate(layer.experts):
            put(f"{p}experts.{e}.gate_up", gu)
            put(f"{p}experts.{e}.down", dn)


def _mla_layer_state(p: str, lay, tensors: dict[str, torch.Tensor], put) -> None:
    """An MLA layer's tensors under prefix ``p`` (gpu/mla.py's ``_MLALayer``: its tensors, linears, experts)."""
    from .mla import _MLALayer  # noqa: PLC0415

    tensors.update({p + n: getattr(lay, n) for n in _MLALayer.TENSORS if getattr(lay, n) is not None})
    for n in _MLALayer.LINEARS:
        if getattr(lay, n) is not None:
            put(p + n, getattr(lay, n))
    for e, (gu, dn) in enumerate(lay.experts or ()):
        put(f"{p}experts.{e}.gate_up", gu)
        put(f"{p}experts.{e}.down", dn)
    if lay.shared is not None:
        put(p + "shared.gate_up", lay.shared[0])
        put(p + "shared.down", lay.shared[1])


def _state_writer(model) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, int], Any]:
    """``(tensors, kinds, out_features, put)`` of :func:`model_state`, holding the final norm, the RoPE table, the
    embedding and the LM head; ``put(name, linear)`` adds a linear."""
    tensors: dict[str, torch.Tensor] = {"norm": model.norm, "inv_freq": model._inv_freq}
    kinds: dict[str, str] = {}
    outputs: dict[str, int] = {}

    def put(name: str, lin) -> None:
        kinds[name], outputs[name] = lin.kind, lin.out_features
        tensors.update({f"{name}.{k}": v for k, v in lin.tensors.items()})

    put("embedding", model.embedding)
    if model.lm_head is not model.embedding:
        put("lm_head", model.lm_head)
    return tensors, kinds, outputs, put


def model_from_state(meta: dict[str, Any], tensors: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                     executor: str = "auto", executor_options: dict[str, Any] | None = None):
    """The model :func:`model_state` saved (tensors used as given, e.g. memory-mapped), on the ``executor`` path
    (``gpu.model.resolve_executor``).

    Raises:
        KeyError, ValueError, TypeError: ``meta`` or ``tensors`` are incomplete or inconsistent.
    """
    import torch

    from .loader import ModelConfig, RopeScaling  # noqa: PLC0415

    cfg = dict(meta["config"])
    if cfg.get("rope_scaling") is not None:
        cfg["rope_scaling"] = RopeScaling(**cfg["rope_scaling"])
    cfg["eos_token_ids"] = tuple(cfg["eos_token_ids"])
    cfg["layer_windows"] = tuple(cfg.get("layer_windows", ()))
    cfg["moe_layers"] = tuple(cfg.get("moe_layers", ()))
    config = ModelConfig(**cfg)
    dev = torch.device(device)
    lin = _linear_reader(meta, tensors, dev)
    mla = meta.get("attention") == "mla"
    layers = [(_mla_layer_from if mla else _layer_from)(config, f"layers.{i}.", tensors, lin, dev)
              for i in range(config.num_layers)]
    if mla:
        from .mla import MLAModel as cls  # noqa: PLC0415
    else:
        from .model import LlamaModel as cls  # noqa: PLC0415
    embedding = lin("embedding")
    if embedding is None:
        raise KeyError("prepared state has no embedding")
    model = cls.__new__(cls)
    model._setup(config, dev, getattr(torch, meta["dtype"]), bool(meta["native"]), embedding,
                 lin("lm_head") or embedding, tensors["norm"].to(dev), layers, tensors["inv_freq"], executor,
                 executor_options)
    return model


def _linear_reader(meta: dict[str, Any], tensors: dict[str, torch.Tensor], dev: torch.device):
    """``lin(name)``: the saved linear ``name`` as a ``QuantLinear`` on ``dev``, None when there is none."""
    from .quant import QuantLinear  # noqa: PLC0415

    kinds = meta["kinds"]

    def lin(name: str):
        if name not in kinds:
            return None
        prefix = name + "."
        return QuantLinear.from_tensors(kinds[name], {k[len(prefix):]: v.to(dev) for k, v in tensors.items()
                                                       if k.startswith(prefix)}, meta["out_features"][name])
    return lin


def _layer_from(config, p: str, tensors: dict[str, torch.Tensor], lin, dev: torch.device):
    """The GQA layer :func:`_layer_state` saved under ``p``."""
    from .layers import Layer  # noqa: PLC0415

    def extra(name: str) -> torch.Tensor | None:
        return tensors[name].to(dev) if name in tensors else None

    def need(name: str):
        found = lin(name)
        if found is None:
            raise KeyError(f"prepared state has no linear {name!r}")
        return found

    sparse = p + "router" in tensors
    experts = [(need(f"{p}experts.{e}.gate_up"), need(f"{p}experts.{e}.down"))
               for e in range(config.num_experts)] if sparse else None
    return Layer(ln_attn=tensors[p + "ln_attn"].to(dev), qkv=need(p + "qkv"), o=need(p + "o"),
                 ln_mlp=tensors[p + "ln_mlp"].to(dev), gate_up=None if sparse else need(p + "gate_up"),
                 down=None if sparse else need(p + "down"), router=extra(p + "router"), experts=experts,
                 **{e: extra(p + e) for e in Layer.EXTRAS})


def _mla_layer_from(config, p: str, tensors: dict[str, torch.Tensor], lin, dev: torch.device):
    """The MLA layer :func:`_mla_layer_state` saved under ``p``."""
    from .mla import _MLALayer  # noqa: PLC0415

    lay = _MLALayer(**{n: tensors[p + n].to(dev) if p + n in tensors else None for n in _MLALayer.TENSORS},
                    **{n: lin(p + n) for n in _MLALayer.LINEARS})
    if lay.router is not None:
        lay.experts = [(lin(f"{p}experts.{e}.gate_up"), lin(f"{p}experts.{e}.down"))
                       for e in range(config.num_experts)]
        if lin(p + "shared.gate_up") is not None:
            lay.shared = (lin(p + "shared.gate_up"), lin(p + "shared.down"))
    return lay
