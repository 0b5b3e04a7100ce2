"""Where the numba.cuda kernels run, and how torch tensors reach them (zero copy).

Three cases, decided once per process when ``numba.cuda`` is imported:

* a CUDA device (``numba.cuda.is_available()``): tensors must be CUDA tensors; they are viewed through
  ``__cuda_array_interface__`` with :func:`numba.cuda.as_cuda_array` (``sync=False``: every launch goes on
  torch's current stream, so no extra synchronisation is needed or wanted), and kernels launch on that stream
  through :func:`numba.cuda.external_stream`;
* the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` in the environment *before* numba is first imported): tensors
  are CPU tensors, passed as numpy views (the simulator copies them in and writes them back around each
  launch, so results land in the tensor). Every thread of a block is a Python thread: use tiny sizes;
* neither: :func:`require_kernels` raises RuntimeError saying what to do.

bfloat16 has no numpy or ``__cuda_array_interface__`` type, so bf16 tensors go to kernels as their int16 bit
pattern (``t.view(torch.int16)``) and the kernels widen the bits themselves (:func:`bf16_to_f32`).
"""
from __future__ import annotations

import contextlib
import functools

import torch


@functools.lru_cache(maxsize=None)
def _cuda():
    from numba import cuda  # noqa: PLC0415 - heavy import, only when a kernel is used

    return cuda


def simulator() -> bool:
    """True when numba runs CUDA kernels in its CPU simulator (``NUMBA_ENABLE_CUDASIM=1`` at import)."""
    from numba import config  # noqa: PLC0415

    return bool(config.ENABLE_CUDASIM)


@functools.lru_cache(maxsize=None)
def cuda_device_available() -> bool:
    """True when a real CUDA device can run numba kernels (never in simulator mode)."""
    if simulator():
        return False
    try:
        return bool(_cuda().is_available())
    except Exception:  # noqa: BLE001 - a broken driver/toolkit counts as "no device"
        return False


def kernels_available() -> bool:
    """True when the numba kernels can run in this process (a CUDA device, or the simulator)."""
    return simulator() or cuda_device_available()


def require_kernels() -> None:
    """Raise RuntimeError (saying what to do) unless :func:`kernels_available`."""
    if not kernels_available():
        raise RuntimeError(
            "the numba.cuda kernels need a CUDA device (none found: numba.cuda.is_available() is False) or "
            "the CUDA simulator (set NUMBA_ENABLE_CUDASIM=1 before numba is imported); on CPU use the torch "
            "path (--attention-backend torch, KV transport cpu-shm)")


def as_kernel_array(t: torch.Tensor):
    """``t`` as an array a numba kernel can take, sharing its memory (no copy).

    CUDA tensor -> numba DeviceNDArray (``as_cuda_array(sync=False)``); CPU tensor under the simulator ->
    numpy view. bf16 tensors must be viewed as int16 by the caller first. Raises ValueError for a CPU tensor
    when a real device is in use (move it with ``.cuda()``), or a CUDA tensor under the simulator.
    """
    require_kernels()
    if t.dtype == torch.bfloat16:
        raise TypeError("pass bfloat16 tensors as t.view(torch.int16): numba has no bfloat16 array type")
    t = t.detach()
    if simulator():
        if t.is_cuda:
            raise ValueError("the CUDA simulator runs on CPU tensors; got a CUDA tensor")
        return t.numpy()
    if not t.is_cuda:
        raise ValueError(f"numba kernels need CUDA tensors; got one on {t.device} (use .cuda())")
    return _cuda().as_cuda_array(t, sync=False)


def launch_stream(t: torch.Tensor):
    """The stream to launch on: torch's current stream of ``t``'s device (0, the default, in the
    simulator)."""
    if simulator() or not t.is_cuda:
        return 0
    return _cuda().external_stream(torch.cuda.current_stream(t.device).cuda_stream)


@contextlib.contextmanager
def on_device_of(t: torch.Tensor):
    """Make ``t``'s GPU numba's current device for a launch (a no-op in the simulator / for device 0 only
    machines); torch and numba share the primary context, so either can allocate."""
    if simulator() or not t.is_cuda:
        yield
        return
    with _cuda().gpus[t.device.index if t.device.index is not None else torch.cuda.current_device()]:
        yield


def multiprocessor_count(device: torch.device | int | None = None) -> int:
    """SMs of the CUDA device (torch's view); 4 in the simulator or without a device (a placeholder that keeps
    default grid sizes small)."""
    if simulator() or not torch.cuda.is_available():
        return 4
    return int(torch.cuda.get_device_properties(device if device is not None else 0).multi_processor_count)
