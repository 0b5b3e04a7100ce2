"""GGUF-quantized linear weights kept in low-bit form, run by gpu/lowbit_cpu.py's int8-activation GEMV.

Two weight forms, both in groups of 32 inputs as GGUF stores them:

- :class:`Int4Groups`: 4-bit codes with a scale and a zero per group, ``w = (q - 8) * scale + zero``: Q4_1's
  ``d * q + m`` is scale ``d``, zero ``m + 8 d``; Q4_0's ``d * (q - 8)`` is scale ``d``, zero 0. Exact.
- :class:`Int5Groups`: 5-bit codes with a scale and a min per group, ``w = q * scale + min``: GGUF's Q5_0, Q5_1
  and Q5_K exactly (Q4_K is Int4Groups: Q4_1's form per sub-block of 32; layouts at the K-quant section below).
- :class:`Int8HalfGroups`: int8 codes with a scale per 16 inputs and a min per 32: GGUF's Q6_K exactly, and any
  of the others converted exactly (a fused linear whose parts differ in type).
- :class:`Int8Groups`: 8-bit codes with a scale per group, GGUF's Q8_0 exactly (used for the token embedding /
  output projection; re-quantizing Q8_0 per row instead costs quality: top-1 agreement 0.96 instead of 0.99 on
  bench/quality's text).

:class:`QuantLinear` runs them on activations quantized to int8 per group (llama.cpp's method; the only rounding
is of the activations) for decode-sized batches, and on an exact float32 copy for prefill-sized ones. Block
layouts follow ggml (``block_q4_0``, ``block_q4_1``, ``block_q8_0`` in ggml-common.h) and mirror
``gguf.quants.Q4_0/Q4_1.dequantize_blocks``; ``tests/gpu/test_quant.py`` checks them against
``gguf.quants.dequantize``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

__all__ = ["GROUP_SIZE", "Int4Groups", "Int5Groups", "Int8Groups", "Int8HalfGroups", "int4_groups_from_gguf",
           "int8_groups_from_float", "kquant_groups_from_gguf", "QuantLinear"]

GROUP_SIZE = 32  # inputs per scale/zero group (GGUF's block size for Q4_0, Q4_1, Q8_0)
Q4_TYPES = ("Q4_0", "Q4_1")


class _RowGroups:
    """What a packed weight whose every field is a tensor with one row per output feature shares: ``shape`` (of
    ``codes``), ``take_rows`` (every field permuted alike) and ``_stacked`` (every field concatenated along N)."""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def take_rows(self, order: np.ndarray):
        idx = torch.from_numpy(np.ascontiguousarray(order))
        return type(self)(*(getattr(self, f.name)[idx] for f in fields(self)))

    @classmethod
    def _stacked(cls, parts: list):
        return cls(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)))


@dataclass
class Int4Groups(_RowGroups):
    """A ``[N, K]`` weight as 4-bit codes in ``(q - 8) * scale + zero`` form, before packing.

    ``codes``: uint8 ``[N, K]`` in 0..15; ``scale``, ``zero``: float32 ``[N, K // 32]``. Rows can be permuted
    (``take_rows``) and several weights stacked along N (``cat``) before :meth:`QuantLinear.int4` packs them.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor



    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``: ``(codes - 8) * scale + zero`` group by group."""
        n, k = self.codes.shape
        q = self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float() - 8.0
        return (q * self.scale[..., None] + self.zero[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list["Int4Groups"]) -> "Int4Groups":
        return Int4Groups._stacked(parts)


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
    ``big`` are the same), ``"int4"``, ``"int5"``, ``"int8"`` and ``"int8h"`` (``fn`` runs gpu/lowbit_cpu.py's GEMV on int8-quantized
    ``x``, its cost linear in ``M``; ``big`` runs ``F.linear`` on the exact float32 weight ``tensors["dense"]``
    when it is there: MKL's fp32 GEMM wins at prefill sizes: `python -m bench.prefill_forward`). ``tensors`` is
    what the prepared-model cache stores (:meth:`from_tensors`).
    """

    __slots__ = ("kind", "tensors", "out_features", "fn", "big")

    def __init__(self, kind: str, tensors: dict[str, torch.Tensor], out_features: int):
        self.kind, self.tensors, self.out_features = kind, tensors, out_features
        self.fn = _bind(kind, tensors, out_features)  # the kernel with its weights bound
        dense = tensors.get("weight" if kind == "dense" else "dense")
        self.big = self.fn if dense is None else (lambda x: torch.nn.functional.linear(x, dense))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    @property
    def in_features(self) -> int:
        t = self.tensors
        if self.kind == "dense":
            return t["weight"].shape[1]
        return t["tile_scale"].shape[1] * GROUP_SIZE

    @property
    def weight_bytes(self) -> int:
        """Bytes ``fn`` reads per call (the tiled weight and its scales; not the dense copy)."""
        return sum(t.numel() * t.element_size() for k, t in self.tensors.items() if k != "dense" or
                   self.kind == "dense")

    @classmethod
    def int4(cls, w: Int4Groups, dense: bool = True) -> "QuantLinear":
        """Tile ``w`` for ``lowbit_cpu.q4_linear`` (codes ``[T, K / 32, 8, 64]`` uint8, scales and mins
        ``[T, K / 32, 32]`` float32, ``T = ceil(N / 32)``); with ``dense``, also the exact float32 weight for
        ``big``."""
        from . import lowbit_cpu  # noqa: PLC0415  (numba: only processes that run the model pay its import)
        tensors = lowbit_cpu.q4_tiles(w.codes, w.scale, w.zero)
        if dense:
            tensors["dense"] = w.dequantize().contiguous()
        return cls("int4", tensors, w.shape[0])

    @classmethod
    def int5(cls, w: "Int5Groups", dense: bool = True) -> "QuantLinear":
        """Tile ``w`` for ``lowbit_cpu.q5_linear`` (codes ``[T, K / 32, 10, 64]`` uint8, scales and mins
        ``[T, K / 32, 32]`` float32); with ``dense``, also the exact float32 weight for ``big``."""
        from . import lowbit_cpu  # noqa: PLC0415
        tensors = lowbit_cpu.q5_tiles(w.codes, w.scale, w.min)
        if dense:
            tensors["dense"] = w.dequantize().contiguous()
        return cls("int5", tensors, w.shape[0])

    @classmethod
    def int8(cls, w: Int8Groups, dense: bool = True) -> "QuantLinear":
        """Tile ``w`` for ``lowbit_cpu.q8_linear`` (codes ``[T, K / 32, 32, 32]`` int8, scales
        ``[T, K / 32, 32]`` float32); with ``dense``, the float32 weight for ``big`` (``w.source`` when known, so
        the dense path is not rounded)."""
        from . import lowbit_cpu  # noqa: PLC0415
        tensors = lowbit_cpu.q8_tiles(w.codes, w.scale)
        if dense:
            tensors["dense"] = w.dequantize().float().contiguous()
        return cls("int8", tensors, w.shape[0])

    @classmethod
    def int8h(cls, w: "Int8HalfGroups", dense: bool = True) -> "QuantLinear":
        """Tile ``w`` for ``lowbit_cpu.q8h_linear`` (codes ``[T, K / 32, 32, 32]`` int8, scales
        ``[T, K / 32, 2, 32]`` and mins ``[T, K / 32, 32]`` float32); with ``dense``, the exact float32 weight."""
        from . import lowbit_cpu  # noqa: PLC0415
        tensors = lowbit_cpu.q8h_tiles(w.codes, w.scale, w.min)
        if dense:
            tensors["dense"] = w.dequantize().contiguous()
        return cls("int8h", tensors, w.shape[0])

    @classmethod
    def dense(cls, w: torch.Tensor) -> "QuantLinear":
        return cls("dense", {"weight": w.contiguous()}, w.shape[0])

    @classmethod
    def from_tensors(cls, kind: str, tensors: dict[str, torch.Tensor], out_features: int) -> "QuantLinear":
        """Rebuild from :attr:`tensors` (already tiled, e.g. memory-mapped from the prepared-model cache).

        Raises:
            ValueError: an unknown ``kind``, missing tensors, or ``out_features`` beyond the tiles' rows.
        """
        need = {"int4": ("tiles", "tile_scale", "tile_min"), "int5": ("tiles", "tile_scale", "tile_min"),
                "int8": ("tiles", "tile_scale"),
                "int8h": ("tiles", "tile_scale", "tile_min"), "dense": ("weight",)}
        if kind not in need or any(k not in tensors for k in need[kind]):
            raise ValueError(f"linear of kind {kind!r} with tensors {sorted(tensors)}")
        rows = tensors["weight"].shape[0] if kind == "dense" else tensors["tile_scale"].shape[0] * tensors[
            "tile_scale"].shape[-1]
        if not 0 < out_features <= rows or (kind == "dense" and out_features != rows):
            raise ValueError(f"linear of kind {kind!r} with {rows} rows cannot have {out_features} outputs")
        return cls(kind, tensors, out_features)


def _bind(kind: str, t: dict[str, torch.Tensor], n: int):
    if kind == "int4":
        from .lowbit_cpu import q4_linear  # noqa: PLC0415
        tiles, scale, mins = t["tiles"], t["tile_scale"], t["tile_min"]
        return lambda x: q4_linear(x, n, tiles, scale, mins)
    if kind == "int5":
        from .lowbit_cpu import q5_linear  # noqa: PLC0415
        tiles, scale, mins = t["tiles"], t["tile_scale"], t["tile_min"]
        return lambda x: q5_linear(x, n, tiles, scale, mins)
    if kind == "int8":
        from .lowbit_cpu import q8_linear  # noqa: PLC0415
        tiles, scale = t["tiles"], t["tile_scale"]
        return lambda x: q8_linear(x, n, tiles, scale)
    if kind == "int8h":
        from .lowbit_cpu import q8h_linear  # noqa: PLC0415
        tiles, scale, mins = t["tiles"], t["tile_scale"], t["tile_min"]
        return lambda x: q8h_linear(x, n, tiles, scale, mins)
    weight = t["weight"]
    return lambda x: torch.nn.functional.linear(x, weight)


# --- K-quants and Q5 (the types a Q4_K_M file holds) ---------------------------------------------------------------
#
# GGUF's K-quants pack super-blocks of 256 inputs (ggml-common.h ``block_q4_K``, ``block_q5_K``, ``block_q6_K``;
# gguf.quants' dequantizers are the reference the tests check against):
#   Q4_K 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) for 8 sub-blocks of 32, 128 bytes of nibbles
#        (32-byte chunk c: low nibbles = sub-block 2c, high = 2c + 1);   w = d sc q - dmin m,  q 0..15
#   Q5_K 176 bytes: Q4_K's head, 32 bytes of high bits (bit s of byte l = sub-block s, input l), 128 of nibbles;
#        w = d sc q - dmin m, q 0..31
#   Q6_K 210 bytes: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 inputs), fp16 d;
#        w = d sc (q - 32), q 0..63
# Q4_K is Q4_1's form per sub-block of 32 (scale d sc, min -dmin m), so it becomes Int4Groups and runs on the
# Q4 tiles. Q5_K (scale d sc, min -dmin m), Q5_0 (llama.cpp's fallback for Q4_K when K % 256 != 0: scale d, min
# -16 d) and Q5_1 (Q5_K's fallback: scale d, min m) become Int5Groups and run on the Q5 tiles (the Q4 tiles plus
# a fifth-bit plane). Q6_K becomes Int8HalfGroups: int8 codes with a scale per 16 inputs.

K_SUPER = 256  # inputs per K-quant super-block
KQUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")
_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q5_0": 22, "Q5_1": 24}
_BLOCK_INPUTS = {"Q4_K": K_SUPER, "Q5_K": K_SUPER, "Q6_K": K_SUPER, "Q5_0": GROUP_SIZE, "Q5_1": GROUP_SIZE}


@dataclass
class Int8HalfGroups(_RowGroups):
    """A ``[N, K]`` weight as ``w = codes * scale[k // 16] + min[k // 32]``: ``codes`` int8 ``[N, K]``,
    ``scale`` float32 ``[N, K // 16]``, ``min`` float32 ``[N, K // 32]``. Q6_K exactly; :meth:`from_int4` /
    :meth:`from_int5` / :meth:`from_int8` take Int4Groups / Int5Groups / Int8Groups exactly too (a fused linear
    whose parts differ in type)."""

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor



    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        w = self.codes.view(n, k // 16, 16).float() * self.scale[..., None]
        return (w.view(n, k // GROUP_SIZE, GROUP_SIZE) + self.min[..., None]).view(n, k)

    @staticmethod
    def from_int4(w: Int4Groups) -> "Int8HalfGroups":
        """``(q - 8) * scale + zero`` as codes ``q - 8``, the scale for both halves, min ``zero``."""
        return Int8HalfGroups((w.codes.to(torch.int16) - 8).to(torch.int8),
                              w.scale.float().repeat_interleave(2, dim=1), w.zero.float())

    @staticmethod
    def from_int5(w: "Int5Groups") -> "Int8HalfGroups":
        """``q * scale + min`` as codes ``q``, the scale for both halves, the same min."""
        return Int8HalfGroups(w.codes.to(torch.int8), w.scale.float().repeat_interleave(2, dim=1), w.min.float())

    @staticmethod
    def from_int8(w: Int8Groups) -> "Int8HalfGroups":
        """``codes * scale`` (Q8_0) with the scale for both halves and min 0."""
        return Int8HalfGroups(w.codes, w.scale.float().repeat_interleave(2, dim=1),
                              torch.zeros(w.scale.shape, dtype=torch.float32))

    @staticmethod
    def cat(parts: list) -> "Int8HalfGroups":
        """Stack along N; Int4Groups, Int5Groups and Int8Groups parts are converted (:meth:`from_int4`,
        :meth:`from_int5`, :meth:`from_int8`)."""
        parts = [Int8HalfGroups.from_int4(p) if isinstance(p, Int4Groups) else
                 Int8HalfGroups.from_int5(p) if isinstance(p, Int5Groups) else
                 Int8HalfGroups.from_int8(p) if isinstance(p, Int8Groups) else p for p in parts]
        return Int8HalfGroups._stacked(parts)


@dataclass
class Int5Groups(_RowGroups):
    """A ``[N, K]`` weight as ``w = codes * scale + min`` per group of 32 inputs: ``codes`` uint8 ``[N, K]`` in
    0..31, ``scale``, ``min`` float32 ``[N, K // 32]``. Q5_0, Q5_1 and Q5_K exactly; :meth:`cat` takes
    Int4Groups parts too (exactly)."""

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor



    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        w = self.codes.view(n, k // GROUP_SIZE, GROUP_SIZE).float() * self.scale[..., None]
        return (w + self.min[..., None]).view(n, k)

    @staticmethod
    def from_int4(w: Int4Groups) -> "Int5Groups":
        """``(q - 8) * scale + zero`` as codes ``q``, min ``zero - 8 scale`` (the Q4 tiles' own min)."""
        return Int5Groups(w.codes, w.scale.float(), w.zero.float() - 8.0 * w.scale.float())

    @staticmethod
    def cat(parts: list) -> "Int5Groups":
        """Stack along N; Int4Groups parts are converted (:meth:`from_int4`)."""
        parts = [Int5Groups.from_int4(p) if isinstance(p, Int4Groups) else p for p in parts]
        return Int5Groups._stacked(parts)


def _fp16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row (last axis) as float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes ``[..., 12]`` -> 6-bit (scale, min) ``[..., 8]`` each (gguf's unpacking)."""
    from gguf.quants import Q4_K  # noqa: PLC0415

    lead = packed.shape[:-1]
    sc, m = Q4_K.get_scale_min(packed.reshape(-1, 12))
    return sc.reshape(lead + (8,)).astype(np.float32), m.reshape(lead + (8,)).astype(np.float32)


def kquant_groups_from_gguf(raw: np.ndarray, type_name: str,
                            shape: tuple[int, int]) -> Int4Groups | Int5Groups | Int8HalfGroups:
    """Unpack a GGUF Q4_K, Q5_K, Q6_K, Q5_0 or Q5_1 tensor without dequantizing it (layouts above).

    Args:
        raw: the tensor's bytes (``GGUFReader`` ``tensor.data``, any shape).
        type_name: one of :data:`KQUANT_TYPES`.
        shape: ``(N, K)`` in HF layout, ``K`` a multiple of the type's block (256 for K-quants, 32 for Q5).
    Returns:
        :class:`Int4Groups` for Q4_K, :class:`Int8HalfGroups` for Q6_K, :class:`Int5Groups` for the others; values equal
        ``gguf.quants.dequantize``'s up to float32 rounding of ``d * sc`` products (exact for these sizes).
    Raises:
        ValueError: another type, or a byte count that does not match ``shape``.
    """
    if type_name not in KQUANT_TYPES:
        raise ValueError(f"K-quant groups come from {', '.join(KQUANT_TYPES)} tensors, not {type_name}")
    n, k = shape
    per, size = _BLOCK_INPUTS[type_name], _BLOCK_BYTES[type_name]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if k % per or blocks.size != n * (k // per) * size:
        raise ValueError(f"{type_name} tensor of {blocks.size} bytes does not hold a [{n}, {k}] weight")
    nb = k // per
    b = blocks.reshape(n, nb, size)
    if type_name in ("Q5_0", "Q5_1"):
        head = 2 if type_name == "Q5_0" else 4
        d = _fp16(b[..., 0:2])                                             # [N, G]
        high = np.ascontiguousarray(b[..., head:head + 4]).view("<u4")[..., 0]  # bit j = input j's fifth bit
        qs = b[..., head + 4:]
        low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)                # [N, G, 32]
        q = low | (((high[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
        mins = -(16.0 * d) if type_name == "Q5_0" else _fp16(b[..., 2:4])   # w = d (q - 16) / w = d q + m
        return Int5Groups(torch.from_numpy(np.ascontiguousarray(q.reshape(n, k))), torch.from_numpy(d),
                          torch.from_numpy(np.ascontiguousarray(mins, dtype=np.float32)))
    if type_name == "Q6_K":
        ql, qh = b[..., :128], b[..., 128:192]
        sc = b[..., 192:208].view(np.int8).astype(np.float32)              # [N, nb, 16]
        d = _fp16(b[..., 208:210])                                         # [N, nb]
        # inputs 128 h + 32 s + l: low nibble of ql[64 h + l + 32 (s & 1)] (s < 2) or high (s >= 2),
        # high bits (qh[32 h + l] >> 2 s) & 3
        low = (ql.reshape(n, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
        hi = (qh.reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
        q = low.reshape(n, nb, 2, 4, 32) | (hi << 4)
        codes = q.reshape(n, k).astype(np.int16) - 32
        scale = (d[..., None] * sc).reshape(n, k // 16)
        return Int8HalfGroups(torch.from_numpy(codes.astype(np.int8)), torch.from_numpy(scale),
                              torch.zeros(n, k // GROUP_SIZE))
    d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])                       # [N, nb]
    sc, m = _k_scale_min(b[..., 4:16])                                     # [N, nb, 8]
    scale = (d[..., None] * sc).reshape(n, k // GROUP_SIZE)
    mins = -(dmin[..., None] * m).reshape(n, k // GROUP_SIZE)
    qs = b[..., -128:].reshape(n, nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, nb, 8, 32)                                  # sub-block 2c + e: nibble e of chunk c
    if type_name == "Q4_K":                                                # (q - 8) scale + zero = scale q + min
        return Int4Groups(torch.from_numpy(np.ascontiguousarray(q.reshape(n, k))), torch.from_numpy(scale),
                          torch.from_numpy(mins + 8.0 * scale))
    qh = b[..., 16:48].reshape(n, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    q = q | ((qh & 1) << 4)
    return Int5Groups(torch.from_numpy(np.ascontiguousarray(q.reshape(n, k))), torch.from_numpy(scale),
                      torch.from_numpy(np.ascontiguousarray(mins)))
