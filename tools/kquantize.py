"""kquantize: a small reference K-quant quantizer (Q4_K, Q5_K, Q6_K blocks) and a Q4_K_M-style re-quantizer of a
GGUF model, for tests and benchmarks (the ``gguf`` package dequantizes K-quants but cannot quantize them).

Run from the repository root::

    python -m tools.kquantize OUT.gguf                 # the embedded SmolLM2 as Q4_K_M (llama.cpp's type mix)
    python -m tools.kquantize OUT.gguf --type Q6_K     # every linear in one type (where K allows it)

The blocks are valid ggml blocks (``gguf.quants.dequantize`` reads them back; tests/gpu/test_kquants.py checks
it), quantized the plain way: per sub-block min/max (Q4_K, Q5_K) or max |w| (Q6_K), the sub-block scales
rounded to 6 / 8 bits against the super-block's largest. llama.cpp's llama-quantize searches scales that lower
the error further, so its files are a little closer to the float weights than these.

The Q4_K_M mix follows llama.cpp's ``llama_tensor_get_type`` for that file type: ``attn_v`` and ``ffn_down``
in Q6_K on the first and last eighth of the layers and every third layer between, else Q4_K; the output
projection (the token embedding when tied) in Q6_K; every other linear in Q4_K. A tensor whose input size is
not a multiple of 256 falls back as llama.cpp's does: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 (the embedded
SmolLM2's hidden size is 576, so there only ``ffn_down`` (input 1536) is a K-quant).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

QK_K = 256
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def _pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit scales and mins ``[..., 8]`` -> ggml's 12 bytes (the inverse of ``gguf.quants.Q4_K.get_scale_min``)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    lo = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    mid = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    hi = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    return np.concatenate([lo, mid, hi], axis=-1)


def _affine_k(w: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's common part for ``w`` ``[N, K]``: (head bytes [N, nb, 16], codes [N, nb, 8, 32] in
    0..levels, with d, dmin as fp16)."""
    n, k = w.shape
    x = w.reshape(n, k // QK_K, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0.0)
    scale_f, min_f = (x.max(-1) - lo) / levels, -lo                       # [N, nb, 8]
    d, dmin = _f16(scale_f.max(-1) / 63), _f16(min_f.max(-1) / 63)      # [N, nb]
    sc = np.clip(np.rint(_div(scale_f, d.astype(np.float32)[..., None])), 0, 63)
    m = np.clip(np.rint(_div(min_f, dmin.astype(np.float32)[..., None])), 0, 63)
    eff_s = d.astype(np.float32)[..., None] * sc
    eff_m = dmin.astype(np.float32)[..., None] * m
    q = np.clip(np.rint(_div(x + eff_m[..., None], eff_s[..., None])), 0, levels).astype(np.uint8)
    head = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8),
                           _pack_scale_min(sc, m)], axis=-1)
    return head, q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """codes [N, nb, 8, 32] (low 4 bits used) -> 128 bytes per super-block: chunk c = sub-blocks 2c | 2c + 1."""
    q = q & 0x0F
    return (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(q.shape[0], q.shape[1], 128)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float ``[N, K]`` (``K % 256 == 0``) -> Q4_K bytes ``[N, K / 256 * 144]``."""
    head, q = _affine_k(w, 15)
    return np.concatenate([head, _nibbles(q)], axis=-1).reshape(w.shape[0], -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """float ``[N, K]`` -> Q5_K bytes ``[N, K / 256 * 176]`` (high bit s of byte l = sub-block s, input l)."""
    head, q = _affine_k(w, 31)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=2, dtype=np.uint8)  # [N, nb, 32]
    return np.concatenate([head, qh, _nibbles(q)], axis=-1).reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float ``[N, K]`` -> Q6_K bytes ``[N, K / 256 * 210]``: ql 128, qh 64, 16 int8 scales, fp16 d."""
    n, k = w.shape
    nb = k // QK_K
    x = w.reshape(n, nb, 16, 16).astype(np.float32)
    scale_f = np.abs(x).max(-1) / 31                                     # [N, nb, 16]
    d = _f16(scale_f.max(-1) / 127)
    sc = np.clip(np.rint(_div(scale_f, d.astype(np.float32)[..., None])), -128, 127)
    eff = d.astype(np.float32)[..., None] * sc
    q = (np.clip(np.rint(_div(x, eff[..., None])), -32, 31) + 32).astype(np.uint8).reshape(n, nb, 2, 4, 32)
    # inputs 128 h + 32 s + l: ql[64 h + 32 (s & 1) + l] holds it in its low (s < 2) or high (s >= 2) nibble
    ql = ((q[:, :, :, 0:2] & 0x0F) | ((q[:, :, :, 2:4] & 0x0F) << 4)).reshape(n, nb, 128)
    qh = ((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=3, dtype=np.uint8).reshape(n, nb, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d[..., None].view(np.uint8)],
                          axis=-1).reshape(n, -1)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    """``w`` float ``[N, K]`` as GGUF bytes of ``type_name`` (a K-quant here, else ``gguf.quants.quantize``)."""
    import gguf  # noqa: PLC0415

    if type_name in QUANTIZERS:
        return QUANTIZERS[type_name](np.ascontiguousarray(w, dtype=np.float32))
    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType[type_name])


def _more_bits(layer: int, n_layers: int) -> bool:
    # llama.cpp's use_more_bits: the first and last eighth of the layers, and every third one between
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(name: str, k: int, n_layers: int, mix: str, tied: bool) -> str:
    """The GGUF type ``name`` (input size ``k``) gets in ``mix`` (``"Q4_K_M"`` or one K-quant type), with
    llama.cpp's fallback when ``k % 256 != 0``."""
    if mix != "Q4_K_M":
        want = mix
    elif name == "output.weight" or (tied and name == "token_embd.weight"):
        want = "Q6_K"
    elif name.endswith(("attn_v.weight", "ffn_down.weight")):
        want = "Q6_K" if _more_bits(int(name.split(".")[1]), n_layers) else "Q4_K"
    else:
        want = "Q4_K"
    return want if k % QK_K == 0 else FALLBACK[want]


def requantize(src: Path, out: Path, mix: str = "Q4_K_M") -> dict[str, int]:
    """Write ``src`` (any GGUF ``gguf.quants`` can dequantize) to ``out`` with its 2-D weights in ``mix``
    (norms stay float32; in a one-type mix the token embedding stays as it was). Returns tensors per type."""
    import gguf  # noqa: PLC0415

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    w = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        w.add_key_value(key, field.contents(), vtype, field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    w.add_file_type({"Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_S,
                     "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_S, "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K}[mix])
    counts: dict[str, int] = {}
    for t in reader.tensors:
        arr = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        keep = arr.ndim != 2 or (mix != "Q4_K_M" and t.name == "token_embd.weight")
        kind = t.tensor_type.name if keep else tensor_type(t.name, arr.shape[1], n_layers, mix, tied)
        if kind == "F32":
            w.add_tensor(t.name, np.ascontiguousarray(arr))
        elif keep:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        else:
            w.add_tensor(t.name, quantize(arr, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
        counts[kind] = counts.get(kind, 0) + 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return counts


def main(argv: list[str] | None = None) -> None:
    from gpu.model_files import default_model_path  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the GGUF file to write")
    ap.add_argument("--model", default="", help="source GGUF; empty = the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--type", default="Q4_K_M", choices=["Q4_K_M", "Q4_K", "Q5_K", "Q6_K"])
    args = ap.parse_args(argv)
    counts = requantize(Path(args.model or default_model_path()), Path(args.out), args.type)
    print(f"wrote {args.out}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))


if __name__ == "__main__":
    main()
