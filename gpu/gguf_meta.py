"""Fast reader for the key/value metadata at the head of a GGUF file (no tensor data is touched).

``gguf.GGUFReader`` builds a numpy view per array element of every field, which takes seconds for a
49k-token vocabulary; the API process only needs the tokenizer and a few config numbers, so this module
parses the header directly from a memory map (tens of milliseconds).

Layout (GGUF v2/v3, little-endian; source: ggml/docs/gguf.md in ggml-org/ggml)::

    magic      4 bytes  b"GGUF"
    version    uint32   2 or 3
    n_tensors  uint64
    n_kv       uint64
    n_kv times:
        key    string   (uint64 byte length + UTF-8 bytes)
        vtype  uint32   one of GGUF_TYPE_* below
        value  scalar | string | array (uint32 element type + uint64 count + elements)
    tensor infos, alignment padding, tensor data (not read here)
"""
from __future__ import annotations

import mmap
import os
import struct
from typing import Any

import numpy as np

from pdserve.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"

# Value types (gguf_type in ggml/include/gguf.h).
GGUF_TYPE_UINT8 = 0
GGUF_TYPE_INT8 = 1
GGUF_TYPE_UINT16 = 2
GGUF_TYPE_INT16 = 3
GGUF_TYPE_UINT32 = 4
GGUF_TYPE_INT32 = 5
GGUF_TYPE_FLOAT32 = 6
GGUF_TYPE_BOOL = 7
GGUF_TYPE_STRING = 8
GGUF_TYPE_ARRAY = 9
GGUF_TYPE_UINT64 = 10
GGUF_TYPE_INT64 = 11
GGUF_TYPE_FLOAT64 = 12

# Fixed-size scalar types: numpy little-endian dtype.
_SCALAR_DTYPES = {
    GGUF_TYPE_UINT8: np.dtype("<u1"),
    GGUF_TYPE_INT8: np.dtype("<i1"),
    GGUF_TYPE_UINT16: np.dtype("<u2"),
    GGUF_TYPE_INT16: np.dtype("<i2"),
    GGUF_TYPE_UINT32: np.dtype("<u4"),
    GGUF_TYPE_INT32: np.dtype("<i4"),
    GGUF_TYPE_FLOAT32: np.dtype("<f4"),
    GGUF_TYPE_BOOL: np.dtype("<u1"),
    GGUF_TYPE_UINT64: np.dtype("<u8"),
    GGUF_TYPE_INT64: np.dtype("<i8"),
    GGUF_TYPE_FLOAT64: np.dtype("<f8"),
}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class _Cursor:
    """Sequential little-endian reads over a buffer; every read is bounds-checked."""

    def __init__(self, buf: Any, path: str):
        self.buf = buf
        self.pos = 0
        self.path = path

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path}: GGUF metadata is truncated at byte {self.pos} (file cut short?)")

    def u32(self) -> int:
        self._need(4)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self) -> int:
        self._need(8)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self) -> str:
        n = self.u64()
        self._need(n)
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def scalar(self, vtype: int) -> Any:
        dt = _SCALAR_DTYPES[vtype]
        self._need(dt.itemsize)
        v = np.frombuffer(self.buf, dtype=dt, count=1, offset=self.pos)[0]
        self.pos += dt.itemsize
        if vtype == GGUF_TYPE_BOOL:
            return bool(v)
        if vtype in (GGUF_TYPE_FLOAT32, GGUF_TYPE_FLOAT64):
            return float(v)
        return int(v)

    def value(self, vtype: int) -> Any:
        if vtype == GGUF_TYPE_STRING:
            return self.string()
        if vtype == GGUF_TYPE_ARRAY:
            etype = self.u32()
            count = self.u64()
            if etype == GGUF_TYPE_STRING:
                return self._string_array(count)
            if etype == GGUF_TYPE_ARRAY:
                return [self.value(GGUF_TYPE_ARRAY) for _ in range(count)]
            dt = _SCALAR_DTYPES.get(etype)
            if dt is None:
                raise ModelLoadError(f"{self.path}: unknown GGUF array element type {etype} at byte {self.pos}")
            self._need(dt.itemsize * count)
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
            self.pos += dt.itemsize * count
            return arr.astype(bool) if etype == GGUF_TYPE_BOOL else arr
        if vtype not in _SCALAR_DTYPES:
            raise ModelLoadError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")
        return self.scalar(vtype)

    def _string_array(self, count: int) -> list[str]:
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        end = len(buf)
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self._need(8)
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                self.pos = pos
                self._need(n)
            append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Every key/value pair of a GGUF file's header.

    Returns:
        ``{key: value}`` with scalars as ``int``/``float``/``bool``/``str``, string arrays as ``list[str]`` and
        numeric arrays as 1-D numpy arrays; plus ``"GGUF.version"`` and ``"GGUF.tensor_count"``.

    Raises:
        ModelLoadError: the file is missing, not a GGUF file, a big-endian or v1 GGUF, or truncated.
    """
    path = os.fspath(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot open the GGUF file ({e.strerror})") from None
    with f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise ModelLoadError(f"{path}: the file is empty, not a GGUF model") from None
        try:
            with memoryview(mm) as view:
                return _parse(view, path)
        finally:
            mm.close()


def _parse(buf: memoryview, path: str) -> dict[str, Any]:
    cur = _Cursor(buf, path)
    cur._need(4)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected {GGUF_MAGIC!r})")
    cur.pos = 4
    version = cur.u32()
    if version not in (2, 3):
        raise ModelLoadError(
            f"{path}: GGUF version {version} is not supported (need 2 or 3, little-endian); "
            "re-convert the model with a current llama.cpp"
        )
    n_tensors = cur.u64()
    n_kv = cur.u64()
    meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors}
    try:
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.u32()
            meta[key] = cur.value(vtype)
    finally:
        # Drop references into the mmap so it can be closed.
        cur.buf = None
    return meta
