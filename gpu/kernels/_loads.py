"""Element loads shared by the kernels: widen a stored value (fp32, fp16, or bf16 bits in int16) to float32.

``kind`` is the storage kind of an array as the kernel sees it: ``"float"`` (float32/float16/float64 arrays:
a plain conversion) or ``"bf16"`` (bfloat16 passed as its int16 bit pattern: the 16 bits become the top half
of a float32, which is exactly bf16 -> fp32). On a device that is one shift and a register reinterpret
(``libdevice.int_as_float``); the simulator has no libdevice, so there it is the same bit trick in numpy.
"""
from __future__ import annotations

import functools

import torch

from . import _runtime as rt


def kind_of(t: torch.Tensor) -> str:
    """The load kind for tensor ``t``: ``"bf16"`` for bfloat16, ``"float"`` for fp16/fp32/fp64."""
    if t.dtype == torch.bfloat16:
        return "bf16"
    if t.dtype in (torch.float16, torch.float32, torch.float64):
        return "float"
    raise TypeError(f"kernel inputs must be float32, float16 or bfloat16 tensors; got {t.dtype}")


def kernel_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernel takes it: bf16 reinterpreted as int16 (same bytes), anything else unchanged."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@functools.lru_cache(maxsize=None)
def load_fn(kind: str):
    """A numba device function ``ld(x) -> float32`` for storage ``kind`` (see the module docstring)."""
    cuda = rt._cuda()
    from numba import float32, int32  # noqa: PLC0415

    if kind == "bf16":
        if rt.simulator():
            import numpy as np  # noqa: PLC0415

            def ld_sim(x):
                bits = np.array([(int(x) & 0xFFFF) << 16], dtype=np.uint32)
                return bits.view(np.float32)[0]

            return cuda.jit(device=True)(ld_sim)
        from numba.cuda import libdevice  # noqa: PLC0415

        @cuda.jit(device=True, inline=True)
        def ld_bf16(x):
            return libdevice.int_as_float((int32(x) & 0xFFFF) << 16)

        return ld_bf16
    if kind != "float":
        raise ValueError(f"unknown load kind {kind!r}")

    @cuda.jit(device=True, inline=True)
    def ld_float(x):
        return float32(x)

    return ld_float
