"""GGUF-quantized linear weights kept in low-bit form and run with torch's CPU weight-only kernels.

Two packed forms; their kernels get bfloat16 copies of the float32 activations (the kernels' fp32-activation
paths are scalar and ~10x slower than a dense fp32 ``F.linear``):

- :class:`Int4Groups`: 4-bit codes with a scale and a zero per group of 32 inputs, as GGUF's Q4_0 and Q4_1 store
  them. ``torch.ops.aten._weight_int4pack_mm_for_cpu`` computes ``w = (q - 8) * scale + zero`` per group (probed
  on torch 2.13: exact against a float reference with fp32 scales), so Q4_1's ``d * q + m`` is scale ``d``, zero
  ``m + 8 d``, and Q4_0's ``d * (q - 8)`` is scale ``d``, zero 0. The only rounding is of the scales and zeros
  to bfloat16.
- :class:`Int8Groups`: 8-bit codes with a scale per group of 32 inputs, GGUF's Q8_0 exactly (used for the token
  embedding / output projection). ``torch.ops.aten._weight_int8pack_mm`` takes one scale per output row, so the
  kernel runs once per group of 32 inputs and the partial products are summed in float32; re-quantizing Q8_0
  per row instead costs far more quality (top-1 agreement 0.96 instead of 0.99 on tools/bench_quality's text).

Block layouts follow ggml (``block_q4_0``, ``block_q4_1``, ``block_q8_0`` in ggml-common.h) and mirror
``gguf.quants.Q4_0/Q4_1.dequantize_blocks``; ``tests/gpu/test_quant.py`` checks them against
``gguf.quants.dequantize``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["GROUP_SIZE", "Int4Groups", "Int8Groups", "int4_groups_from_gguf", "int8_groups_from_float",
           "QuantLinear"]

GROUP_SIZE = 32  # inputs per scale/zero group (GGUF's block size for Q4_0, Q4_1, Q8_0)
Q4_TYPES = ("Q4_0", "Q4_1")


@dataclass
class Int4Groups:
    """A ``[N, K]`` weight as 4-bit codes in ``(q - 8) * scale + zero`` form, before packing.

    ``codes``: uint8 ``[N, K]`` in 0..15; ``scale``, ``zero``: float32 ``[N, K // 32]``. Rows can be permuted
    (``take_rows``) and several weights stacked along N (``cat``) before :meth:`QuantLinear.int4` packs them.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def take_rows(self, order: np.ndarray) -> "Int4Groups":
        idx = torch.from_numpy(np.ascontiguousarray(order))
        return Int4Groups(self.codes[idx], self.scale[idx], self.zero[idx])

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``: ``(codes - 8) * scale + zero`` group by group."""
        n, k = self.codes.shape
        q = self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float() - 8.0
        return (q * self.scale[..., None] + self.zero[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list["Int4Groups"]) -> "Int4Groups":
        return Int4Groups(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]))


@dataclass
class Int8Groups:
    """A ``[N, K]`` weight as int8 codes ``[N, K]`` times a float32 scale per group of 32 inputs ``[N, K // 32]``
    (GGUF's Q8_0 exactly); ``source``: the float32 weight it was quantized from, when known."""

    codes: torch.Tensor
    scale: torch.Tensor
    source: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def take_rows(self, order: np.ndarray) -> "Int8Groups":
        idx = torch.from_numpy(np.ascontiguousarray(order))
        return Int8Groups(self.codes[idx], self.scale[idx], None if self.source is None else self.source[idx])

    def dequantize(self) -> torch.Tensor:
        if self.source is not None:
            return self.source
        n, k = self.codes.shape
        return (self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float() * self.scale[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list["Int8Groups"]) -> "Int8Groups":
        sources = None if any(p.source is None for p in parts) else torch.cat([p.source for p in parts])
        return Int8Groups(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), sources)


def int4_groups_from_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Groups:
    """Unpack a GGUF Q4_0 or Q4_1 tensor without dequantizing it.

    Args:
        raw: the tensor's bytes (``GGUFReader`` ``tensor.data``, any shape), ``N * K / 32`` blocks.
        type_name: ``"Q4_0"`` (block: fp16 ``d``, 16 bytes of nibbles; ``w = d (q - 8)``) or ``"Q4_1"`` (fp16
            ``d``, fp16 ``m``, 16 bytes; ``w = d q + m``). Nibble ``j`` of a block is byte ``j``'s low half for
            ``j < 16``, byte ``j - 16``'s high half otherwise.
        shape: ``(N, K)`` in HF layout (rows = output features), ``K % 32 == 0``.
    Raises:
        ValueError: another type, or a byte count that does not match ``shape``.
    """
    if type_name not in Q4_TYPES:
        raise ValueError(f"int4 groups come from Q4_0 or Q4_1 tensors, not {type_name}")
    n, k = shape
    head = 2 if type_name == "Q4_0" else 4  # bytes of d (and m) before the 16 bytes of codes
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if k % GROUP_SIZE or blocks.size != n * (k // GROUP_SIZE) * (head + 16):
        raise ValueError(f"{type_name} tensor of {blocks.size} bytes does not hold a [{n}, {k}] weight")
    blocks = blocks.reshape(n, k // GROUP_SIZE, head + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    qs = blocks[..., head:]  # [N, K/32, 16]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)  # [N, K] uint8 0..15
    if type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8.0 * d
    else:
        zero = np.zeros_like(d)
    return Int4Groups(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(d),
                      torch.from_numpy(zero))


def int8_groups_from_float(w: torch.Tensor) -> Int8Groups:
    """Symmetric int8 quantization of a float ``[N, K]`` weight per group of 32 inputs (``scale = max |w| / 127``,
    ggml's ``quantize_row_q8_0``): a Q8_0 tensor's dequantized values come back to its own codes exactly."""
    w = w.float().contiguous()
    n, k = w.shape
    groups = w.view(n, k // GROUP_SIZE, GROUP_SIZE)
    scale = groups.abs().amax(dim=-1) / 127.0  # [N, K/32]
    codes = torch.round(groups / scale.clamp_min(1e-30)[..., None]).clamp_(-127, 127).to(torch.int8)
    return Int8Groups(codes.view(n, k), scale, w)


class QuantLinear:
    """``y = x @ w.T`` over one weight ``[N, K]``: ``linear.fn(x)`` for few rows, ``linear.big(x)`` for many.

    ``x`` and ``y`` are float32 ``[M, K]`` / ``[M, N]`` on every path. Kinds: ``"dense"`` (``F.linear``; ``fn`` and
    ``big`` are the same), ``"int4"`` and ``"int8"`` (``fn`` runs the weight-only kernel on bfloat16 copies of
    ``x``; ``big`` runs ``F.linear`` on the float32 weight ``tensors["dense"]`` when it is there: these kernels
    are compute-bound on CPUs without native bfloat16 and lose to MKL's fp32 GEMM at prefill sizes, see
    docs/performance.md). ``raw`` is ``fn`` without the final cast: ``x`` float32 or bfloat16, ``y`` in the
    kernel's output dtype (bfloat16 for int4, else float32); upcasting bfloat16 is exact, so a caller that adds
    or multiplies ``y`` into float32 tensors gets ``fn``'s values with one op fewer (the decode loop does).
    ``tensors`` is what the prepared-model cache stores (:meth:`from_tensors`).
    """

    __slots__ = ("kind", "tensors", "out_features", "fn", "big", "raw")

    def __init__(self, kind: str, tensors: dict[str, torch.Tensor], out_features: int):
        self.kind, self.tensors, self.out_features = kind, tensors, out_features
        self.raw = _bind(kind, tensors)  # the kernel with its weights bound: hot loops call ``linear.raw(x)``
        raw = self.raw
        self.fn = (lambda x: raw(x).float()) if kind == "int4" else raw
        dense = tensors.get("weight" if kind == "dense" else "dense")
        self.big = self.fn if dense is None else (lambda x: torch.nn.functional.linear(x, dense))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    @property
    def in_features(self) -> int:
        t = self.tensors
        return {"dense": lambda: t["weight"].shape[1], "int4": lambda: t["packed"].shape[1] * 2,
                "int8": lambda: t["codes"].shape[0] * t["codes"].shape[2]}[self.kind]()

    @property
    def weight_bytes(self) -> int:
        """Bytes ``fn`` reads per call (the packed weight and its scales; not the dense copy)."""
        return sum(t.numel() * t.element_size() for k, t in self.tensors.items() if k != "dense" or
                   self.kind == "dense")

    @classmethod
    def int4(cls, w: Int4Groups, dense: bool = True) -> "QuantLinear":
        """Pack ``w`` for ``_weight_int4pack_mm_for_cpu``: codes ``[N, K / 2]`` uint8, scales and zeros
        ``[K / 32, N, 2]`` bfloat16; with ``dense``, also the exact float32 weight for ``big``."""
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes.to(torch.int32).contiguous(), 1)
        scale_zero = torch.stack([w.scale.t(), w.zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        tensors = {"packed": packed, "scale_zero": scale_zero}
        if dense:
            tensors["dense"] = w.dequantize().contiguous()
        return cls("int4", tensors, w.shape[0])

    @classmethod
    def int8(cls, w: Int8Groups, dense: bool = True) -> "QuantLinear":
        """Codes ``[K / 32, N, 32]`` int8 and scales ``[K / 32, N]`` bfloat16 (group ``g``'s codes and scales are
        contiguous ``[N, 32]`` / ``[N]`` blocks, one ``_weight_int8pack_mm`` call each); with ``dense``, the float32
        weight for ``big`` (``w.source`` when known, so the dense path is not rounded)."""
        n, k = w.shape
        codes = w.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).transpose(0, 1).contiguous()
        tensors = {"codes": codes, "scale": w.scale.t().to(torch.bfloat16).contiguous()}
        if dense:
            tensors["dense"] = w.dequantize().float().contiguous()
        return cls("int8", tensors, w.shape[0])

    @classmethod
    def dense(cls, w: torch.Tensor) -> "QuantLinear":
        return cls("dense", {"weight": w.contiguous()}, w.shape[0])

    @classmethod
    def from_tensors(cls, kind: str, tensors: dict[str, torch.Tensor]) -> "QuantLinear":
        """Rebuild from :attr:`tensors` (already packed, e.g. memory-mapped from the prepared-model cache).

        Raises:
            ValueError: an unknown ``kind`` or missing tensors.
        """
        need = {"int4": ("packed", "scale_zero"), "int8": ("codes", "scale"), "dense": ("weight",)}
        if kind not in need or any(k not in tensors for k in need[kind]):
            raise ValueError(f"linear of kind {kind!r} with tensors {sorted(tensors)}")
        n = tensors["weight"].shape[0] if kind == "dense" else tensors[need[kind][1]].shape[1]
        return cls(kind, tensors, n)


def _bind(kind: str, t: dict[str, torch.Tensor]):
    if kind == "int4":
        op, packed, scale_zero = torch.ops.aten._weight_int4pack_mm_for_cpu, t["packed"], t["scale_zero"]
        return lambda x: op(x.to(torch.bfloat16), packed, GROUP_SIZE, scale_zero)  # [M, N] bfloat16
    if kind == "int8":
        op, codes, scale = torch.ops.aten._weight_int8pack_mm, t["codes"], t["scale"]
        groups, width = codes.shape[0], codes.shape[2]

        def int8_groups(x: torch.Tensor) -> torch.Tensor:
            # xg: [K/32, M, 32]; y = sum over groups of x_g @ (codes_g * scale_g).T, accumulated in float32
            xg = x.to(torch.bfloat16).view(len(x), groups, width).transpose(0, 1).contiguous()
            y = op(xg[0], codes[0], scale[0]).float()
            for g in range(1, groups):
                y.add_(op(xg[g], codes[g], scale[g]))
            return y

        return int8_groups
    weight = t["weight"]
    return lambda x: torch.nn.functional.linear(x, weight)
