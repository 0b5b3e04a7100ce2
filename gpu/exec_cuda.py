"""The CUDA path: the model on a torch CUDA device in its checkpoint's dtype (bf16 or float32), decode attention by
the numba paged-attention kernel of gpu/kernels (or torch SDPA), linears by one swappable function.

| piece | what |
|---|---|
| :func:`cuda_executor` | the executor of a model's attention kind: :class:`CudaExecutor` (GQA) or :class:`MLACudaExecutor` |
| :class:`CudaExecutor` | gpu/exec_torch.py's loops with two hooks replaced: ``attend_decode`` (``attention_backend``) and ``linear`` (``linear_backend``) |
| :class:`MLACudaExecutor` | DeepSeek's MLA decode as MQA over the latent (one kv head, head dim ``rank + rope``), absorbed weights |
| :data:`LINEAR_BACKENDS` | name -> ``fn(x [M, K], w [N, K]) -> [M, N]``: ``"torch"`` (``F.linear``: cuBLAS), ``"numba"`` (``gpu.kernels.tiled_linear``) |

Knobs (``LlamaModel.from_path(..., executor="cuda", executor_options={...})``):

- ``attention_backend``: ``"numba"`` (``gpu.kernels.paged_attention_decode`` per layer over the pool itself, no
  gather) or ``"torch"`` (SDPA over the pages gathered into ``[B, Hkv, S, D]``, gpu/exec_torch.py's). Prefill
  attention is SDPA per packed sequence on both. A layer the kernel cannot compute (a sliding window, soft-capped
  scores) runs the torch form whatever the backend (``kernel_layers`` lists those that do not).
- ``linear_backend``: a name of :data:`LINEAR_BACKENDS` or any function of that signature (the single reference a
  tensor-core kernel replaces); every dense linear of prefill and decode goes through it.
- ``target_ctas``: the paged kernel's FlashDecoding split (None: one CTA per sequence and kv head).

MLA: the pool holds each token's row ``c ++ k_rope`` split over the K and V planes (gpu/mla.py), and the kernel
reads scores from the K plane and values from the V plane of equal head dims, so it cannot read that layout in
place. Per step the executor copies the rows of the blocks the batch uses into a latent pool
``[2, used_blocks, block_tokens, 1, rank + rope]`` (both planes one view of the same rows), absorbs ``W_uk`` into
the query (``q_lat[h] = q_nope[h] @ W_uk[h]``, DeepSeek-V2 section 2.1.2; vLLM's and SGLang's MLA decode) and
runs the kernel as MQA (one kv head; query heads in launches whose shared memory fits), then applies ``W_uv`` to
the first ``rank`` outputs. That copy costs one read and write of the context's latent per layer and step.

Under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` before numba is imported) the same executor runs on CPU
tensors (tiny sizes: each CUDA thread is a Python thread). Without a device or the simulator it refuses to build.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .exec_torch import DecodeStep, TorchExecutor
from .kernels import _runtime as rt
from .kernels import (copy_blocks, cuda_device_available, mma_attention_decode, mma_linear, paged_attention_decode,
                      tiled_linear)
from .kernels.paged_attention import STATIC_SHARED_LIMIT
from .mla import MLATorchExecutor
from .quant import QuantLinear

# gpu/cuda_ipc.py's block copy and device probe come through here too: this module is the one door to gpu.kernels
__all__ = ["ATTENTION_BACKENDS", "CudaExecutor", "LINEAR_BACKENDS", "MLACudaExecutor", "copy_blocks",
           "cuda_device_available", "cuda_executor", "heads_per_launch"]

ATTENTION_BACKENDS = ("numba", "mma", "torch")
LinearFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LINEAR_BACKENDS: dict[str, LinearFn] = {"torch": F.linear, "numba": tiled_linear, "mma": mma_linear}


def cuda_executor(model: Any, attention_backend: str = "numba", linear_backend: str | LinearFn = "torch",
                  target_ctas: int | None = None) -> "CudaExecutor | MLACudaExecutor":
    """The CUDA executor of ``model``'s attention kind (``Family.attention``), knobs as the module docstring.

    Raises:
        ValueError: an unknown backend, native weights, or a model on a device the path cannot run on (a CUDA
            device, or CPU under the simulator).
        RuntimeError: a numba backend without a CUDA device or the simulator.
    """
    cls = MLACudaExecutor if model.config.spec.attention == "mla" else CudaExecutor
    return cls(model, attention_backend, linear_backend, target_ctas)


class _CudaHooks:
    """What both CUDA executors share: the knobs, their checks, the linear hook and the kernel's block tables."""

    name = "cuda"

    def _configure(self, model: Any, attention_backend: str, linear_backend: str | LinearFn,
                   target_ctas: int | None) -> None:
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend {attention_backend!r}: must be one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if isinstance(linear_backend, str) and linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend {linear_backend!r}: must be one of {', '.join(LINEAR_BACKENDS)} or a "
                             "function (x [M, K], w [N, K]) -> [M, N]")
        if model.native:
            raise ValueError("the cuda path runs dense weights (float32 or bfloat16), not native low-bit ones")
        uses_kernels = attention_backend != "torch" or linear_backend in ("numba", "mma")
        if uses_kernels:
            rt.require_kernels()
        want = "cpu" if rt.simulator() else "cuda"
        if model.device.type != want:
            where = "CPU tensors under the CUDA simulator" if want == "cpu" else "a CUDA device"
            raise ValueError(f"the cuda path runs on {where}; the model is on {model.device}")
        self.attention_backend = attention_backend
        self.linear_fn: LinearFn = LINEAR_BACKENDS[linear_backend] if isinstance(linear_backend, str) \
            else linear_backend
        self.target_ctas = target_ctas

    def linear(self, lin: QuantLinear, x: torch.Tensor, big: bool) -> torch.Tensor:
        """``lin`` (dense: the only kind on this path) over ``x`` ``[N, K]`` -> ``[N, out]`` by ``linear_fn``."""
        return self.linear_fn(x, lin.tensors["weight"])

    def decode_step(self, kv: torch.Tensor, positions: list[int], padded: list[list[int]],
                    w_blk: list[int]) -> DecodeStep:
        """gpu/exec_torch.py's step plus the kernel's ``tables`` int32 ``[B, blocks]`` and ``lens`` int32 ``[B]``
        (keys per row, its new token included) in ``step.extra``."""
        step = super().decode_step(kv, positions, padded, w_blk)
        dev = self.m.device
        step.extra["tables"] = torch.tensor(padded, dtype=torch.int32, device=dev)  # [B, blocks]
        step.extra["lens"] = (step.pos_t + 1).to(torch.int32)  # [B]
        return step


class CudaExecutor(_CudaHooks, TorchExecutor):
    """A GQA model on a CUDA device (or the simulator): gpu/exec_torch.py's loops, decode attention by
    ``attention_backend``, linears by ``linear_fn``."""

    def __init__(self, model: Any, attention_backend: str = "numba", linear_backend: str | LinearFn = "torch",
                 target_ctas: int | None = None):
        TorchExecutor.__init__(self, model)
        self._configure(model, attention_backend, linear_backend, target_ctas)
        c = model.config
        # the layers the paged kernel computes exactly: no sliding window, no soft-capped scores; the tensor-core
        # kernel also needs bf16, a head dim of 16s and at most 16 query heads per kv head
        mma_ok = (model.dtype == torch.bfloat16 and c.head_dim % 16 == 0
                  and c.num_heads // c.num_kv_heads <= 16)
        self.kernel_layers = [li for li, wnd in enumerate(model._windows)
                              if attention_backend != "torch" and wnd == 0 and c.attn_softcap is None
                              and (attention_backend == "numba" or mma_ok)]

    def attend_decode(self, li: int, q: torch.Tensor, kv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                      step: DecodeStep) -> torch.Tensor:
        """q ``[B, H, D]`` -> ``[B, H, D]`` by the paged kernel over layer ``li`` of the pool (its new K/V already
        written), or the torch gather + SDPA (``[B, H, 1, D]``)."""
        if li not in self.kernel_layers:
            return super().attend_decode(li, q, kv, k_pool, v_pool, step)
        if self.attention_backend == "mma":
            return mma_attention_decode(q.contiguous(), kv, step.extra["tables"], step.extra["lens"], layer=li,
                                        scale=self.m._scale).to(q.dtype)
        return paged_attention_decode(q.contiguous(), kv, step.extra["tables"], step.extra["lens"], layer=li,
                                      scale=self.m._scale, target_ctas=self.target_ctas, max_seq_len=step.S)


class MLACudaExecutor(_CudaHooks, MLATorchExecutor):
    """A DeepSeek (MLA) model on a CUDA device (or the simulator): decode attention as MQA over the latent by the
    paged kernel (module docstring), or the torch form (``attention_backend="torch"``)."""

    def __init__(self, model: Any, attention_backend: str = "numba", linear_backend: str | LinearFn = "torch",
                 target_ctas: int | None = None):
        MLATorchExecutor.__init__(self, model)
        self._configure(model, attention_backend, linear_backend, target_ctas)
        c = model.config
        self.latent_dim = c.kv_lora_rank + c.qk_rope_head_dim  # the kernel's head dim
        self.heads_per_launch = heads_per_launch(c.num_heads, self.latent_dim)
        self.kernel_layers = list(range(c.num_layers)) if attention_backend != "torch" else []   # mma: the numba
        # kernel here (the latent's 576 dims x H heads fit no 16-row tile; MQA over it is the numba kernel's)

    def decode_step(self, kv: torch.Tensor, positions: list[int], padded: list[list[int]],
                    w_blk: list[int]) -> DecodeStep:
        """Also the blocks the batch uses (``used`` int64 ``[U]``) and the tables renumbered into them, once per
        step for every layer's latent pool."""
        step = super().decode_step(kv, positions, padded, w_blk)
        used = sorted({b for row in padded for b in row})
        where = {b: i for i, b in enumerate(used)}
        dev = self.m.device
        step.extra["used"] = torch.tensor(used, dtype=torch.long, device=dev)  # [U]
        step.extra["tables"] = torch.tensor([[where[b] for b in row] for row in padded], dtype=torch.int32,
                                            device=dev)  # [B, blocks] into the latent pool
        return step

    def attend_decode_mla(self, li: int, layer: Any, q: torch.Tensor, kv: torch.Tensor, kv_flat: torch.Tensor,
                          step: DecodeStep) -> torch.Tensor:
        """q ``[B, H, nope + rope]`` -> ``[B, H, 1, v]``: absorbed MQA over the latent rows by the paged kernel."""
        if li not in self.kernel_layers:
            return super().attend_decode_mla(li, layer, q, kv, kv_flat, step)
        m = self.m
        c = m.config
        H, nope, rank = c.num_heads, c.qk_nope_head_dim, c.kv_lora_rank
        w = layer.kv_b.tensors["weight"].view(H, nope + c.v_head_dim, rank)  # [H, nope + v, rank]
        w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, nope, rank], [H, v, rank]
        q_lat = torch.einsum("bhn,hnr->bhr", q[..., :nope], w_uk)  # [B, H, rank]
        q_abs = torch.cat([q_lat, q[..., nope:]], dim=-1).contiguous()  # [B, H, rank + rope]
        used = step.extra["used"]
        rows = torch.cat([kv[li, 0].index_select(0, used), kv[li, 1].index_select(0, used)], dim=-1)
        # rows: [U, block_tokens, 1, rank + rope]; the latent pool's K and V planes are both these rows
        latent = rows.unsqueeze(0).expand(2, *rows.shape)  # [2, U, block_tokens, 1, rank + rope]
        g = self.heads_per_launch
        o = torch.cat([paged_attention_decode(q_abs[:, h:h + g].contiguous(), latent, step.extra["tables"],
                                              step.extra["lens"], scale=m._scale, target_ctas=self.target_ctas,
                                              max_seq_len=step.S)
                       for h in range(0, H, g)], dim=1)  # [B, H, rank + rope]
        out = torch.einsum("bhr,hvr->bhv", o[..., :rank].to(q.dtype), w_uv)  # [B, H, v]
        return out.unsqueeze(2)  # [B, H, 1, v]


def heads_per_launch(heads: int, head_dim: int, tile_tokens: int = 8) -> int:
    """How many query heads of one kv head the paged kernel takes per launch so that its shared memory (q
    ``[G, D]``, K ``[T, D + 1]``, V ``[T, D]``, scores ``[G, T]``, 3 ``[G]`` vectors, float32) fits 48 KiB with
    tiles of ``tile_tokens`` keys: ``heads`` where it fits (a tiny model), 5 for DeepSeek-V2's 576-dim latent."""
    g = heads
    while g > 1 and 4 * (g * head_dim + tile_tokens * (2 * head_dim + 1) + g * tile_tokens + 3 * g) \
            > STATIC_SHARED_LIMIT:
        g -= 1
    return g
