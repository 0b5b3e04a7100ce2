"""Decoder forward pass in plain torch over a paged KV cache, for every family in gpu/families.py.

The model is the Hugging Face ``LlamaForCausalLM`` computation
(``transformers/models/llama/modeling_llama.py``): RMSNorm, RoPE in the ``rotate_half`` convention,
grouped-query attention, SwiGLU MLP, optional tied embeddings; the config's :class:`gpu.families.Family` and its
per-checkpoint fields switch on what other families add (Q/K/V biases, per-head Q/K RMSNorm, ``1 + w`` norms,
pre/post "sandwich" norms, GeGLU, scaled embeddings, attention and final logit soft-capping, a custom attention
scale, sliding-window layers with their own RoPE base). Weights are kept in ``[out, in]`` layout so
every projection is one call (``gpu.quant.QuantLinear``: a dense ``F.linear`` or, with native GGUF weights, an
int4/int8 GEMV over int8-quantized activations); Q/K/V and gate/up are concatenated, so a layer is four matmuls.

Paged KV cache (the layout of vLLM's PagedAttention, Kwon et al. 2023). The caller owns the pool::

    kv: [num_layers, 2, num_blocks, block_tokens, num_kv_heads, head_dim]     index 0 = K, 1 = V

A request's K/V for token position ``p`` lives at block ``block_table[p // block_tokens]``, offset
``p % block_tokens``. The model only writes the slots of the tokens it is given and only reads slots of
positions ``< position`` it attends to, so unwritten (even NaN) memory elsewhere in the pool is never read.
"""
from __future__ import annotations

import dataclasses
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from .loader import ModelConfig, RopeScaling, load_weights
from .quant import Int4Groups, Int8Groups, Int8HalfGroups, QuantLinear, int8_groups_from_float

__all__ = ["LlamaModel", "WEIGHT_MODES", "from_path", "kv_bytes_per_token", "kv_pool_shape", "resolve_weights_mode",
           "rope_inv_freq"]


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes in all layers.

    ``num_layers * 2 * num_kv_heads * head_dim * itemsize`` (K and V).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize


def kv_pool_shape(config: ModelConfig, num_blocks: int, block_tokens: int) -> tuple[int, ...]:
    """Shape of the KV pool tensor: ``(num_layers, 2, num_blocks, block_tokens, num_kv_heads, head_dim)``."""
    return (config.num_layers, 2, num_blocks, block_tokens, config.num_kv_heads, config.head_dim)


def rope_inv_freq(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim // 2]`` float32, with the config's scaling applied.

    ``inv_freq[i] = rope_theta ** (-2i / head_dim)`` (Su et al., RoFormer). ``linear`` divides by ``factor``;
    ``llama3`` applies Llama 3.1's wavelength-dependent scaling (source: transformers
    ``modeling_rope_utils._compute_llama3_parameters``). ``freq_factors`` (a GGUF ``rope_freqs`` tensor)
    divide the frequencies as llama.cpp's ``ggml_rope_ext`` does.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = config.rope_scaling
    if rs is not None and rs.rope_type == "linear":
        inv_freq = inv_freq / rs.factor
    elif rs is not None and rs.rope_type == "llama3":
        old_len = rs.original_max_position_embeddings
        low_wavelen = old_len / rs.low_freq_factor
        high_wavelen = old_len / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.float().cpu()
    return inv_freq


@dataclass
class _Layer:
    ln_attn: torch.Tensor  # [hidden]
    qkv: QuantLinear  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: QuantLinear  # [hidden, heads * head_dim]
    ln_mlp: torch.Tensor  # [hidden]: the MLP's pre-norm
    gate_up: QuantLinear | None  # [2 * intermediate, hidden]; None in a sparse (MoE) layer
    down: QuantLinear | None  # [hidden, intermediate]
    # family extras (gpu/families.py), None when the family has none; norm weights hold offset + w
    qkv_bias: torch.Tensor | None = None  # [(heads + 2 * kv_heads) * head_dim]
    q_norm: torch.Tensor | None = None  # [head_dim]
    k_norm: torch.Tensor | None = None  # [head_dim]
    post_attn: torch.Tensor | None = None  # [hidden]: norm of the attention output (sandwich norms)
    post_mlp: torch.Tensor | None = None  # [hidden]: norm of the MLP output
    router: torch.Tensor | None = None  # [experts, hidden]: a sparse layer's router (float32)
    experts: list[tuple[QuantLinear, QuantLinear]] | None = None  # per expert: gate_up [2 I, hidden], down

    EXTRAS = ("qkv_bias", "q_norm", "k_norm", "post_attn", "post_mlp")


WEIGHT_MODES = ("auto", "float32", "bfloat16")
# native weights: prefills of >= this many tokens run the layers' float32 copies (see QuantLinear) with the bits of
# PREFILL_BLOCK_ROWS-row calls. 1 = every prefill: the low-bit GEMVs are batch-invariant too and no slower at 16-1000
# tokens (`python -m bench.prefill_forward --lengths 1,16,200,1000`), but their int8-rounded activations flip
# SmolLM2's first answer token at a near tie ("What is the capital of France?": "L'Étoile..." instead of "The
# capital... Paris"). The engine's ``--prefill-low-bit`` sets a model's ``dense_min_tokens`` past any prompt instead
# (actors/shell.configure_model)
DENSE_MIN_TOKENS = 1
# native weights, decode steps (`python -m bench.quality --decode-steps`): steps of fewer than DECODE_STACKED_MAX_ROWS
# rows run the low-bit GEMV, in lowbit_cpu.decode_layers where the layer is Llama's (measured 1.5-2.6x cheaper than
# the float32 copies at 1-64 rows; not measured beyond), op by op otherwise; the output projection over >=
# HEAD_DENSE_MIN_ROWS rows uses its float32 copy. Both limits are equal: a row's logits then come from the same kernel
# in every step of the invariant path (at 32 the float32 head gave a row of a full batch other logits than alone; the
# int8 one costs no more at 32-64 rows: `python -m bench.anchors`)
DECODE_STACKED_MAX_ROWS = 65
HEAD_DENSE_MIN_ROWS = DECODE_STACKED_MAX_ROWS
# native weights: a row of the float32 copies' GEMMs gets the bits it gets in a call of this many rows on one thread
# (a short call zero-padded to it), so a prompt's KV does not depend on how it was packed with others or how much of
# it the prefix cache held. MKL (torch 2.13.0+cpu) gives a row those bits in a call of any 12-2300 rows, on one or two
# threads (`python -m bench.prefill_forward`), so a pass runs one call over all its rows where ``gemm_plan`` finds
# that on the machine, blocks of this many rows otherwise (MKL gives a row the same bits at any place of such a block)
PREFILL_BLOCK_ROWS = 32
# the row counts ``gemm_plan`` tries: short and long, odd and even, in and beyond a few blocks
GEMM_PROBE_ROWS = (32, 33, 47, 100, 161)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Torch's intra-op thread count set to ``n`` inside the block and put back after, whatever happens; ``n`` 0
    (or the count already set) leaves it alone."""
    before = torch.get_num_threads()
    if n <= 0 or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def gemm_rows(fn, x: torch.Tensor, whole: bool, threads: int = 0) -> torch.Tensor:
    """``fn`` (a float32 GEMM ``[M, K] -> [M, N]``) over ``x`` ``[n, K]`` -> ``[n, N]``: one call over all rows
    (``whole``) or over blocks of PREFILL_BLOCK_ROWS rows, a call of fewer rows zero-padded to that; on ``threads``
    torch threads (0: torch's count)."""
    n, r = x.shape[0], PREFILL_BLOCK_ROWS
    pad = max(0, r - n) if whole else -n % r
    xp = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
    with torch_threads(threads):
        if whole:
            return fn(xp)[:n]
        return torch.cat([fn(xp[i:i + r]) for i in range(0, xp.shape[0], r)])[:n]


def gemm_plan(fn, in_features: int, threads: int, rows: tuple[int, ...] = GEMM_PROBE_ROWS) -> tuple[bool, int]:
    """How :func:`gemm_rows` runs ``fn`` (a float32 GEMM over ``[M, in_features]``) so that every row gets the bits
    of a PREFILL_BLOCK_ROWS-row call on one thread: ``(whole, threads)``, found by running it over random rows at
    each count of ``rows``: one call over all rows on ``threads`` where that gave those bits at every count, else
    blocks on ``threads`` where those did, else blocks on one thread. The bits of a GEMM depend on the library's
    kernels (the CPU, the thread count), not on the numbers, so a plan holds for every call of that shape."""
    x = torch.randn(max(rows), in_features, generator=torch.Generator().manual_seed(0))
    ref = gemm_rows(fn, x, whole=False, threads=1)

    def same(whole: bool, t: int) -> bool:
        return all(torch.equal(gemm_rows(fn, x[:m], whole, t), ref[:m]) for m in rows)

    threads = max(1, threads)
    if same(True, threads):
        return True, threads
    return False, threads if threads == 1 or same(False, threads) else 1


def resolve_weights_mode(mode: str, device: str | torch.device = "cpu") -> str:
    """``"native"`` (GGUF Q4_0/Q4_1/Q8_0 and Q4_K/Q5_K/Q6_K/Q5_0/Q5_1 kept in low bits, int8-quantized activations;
    CPU only) for ``"auto"``
    on a CPU, else ``"float32"`` or ``"bfloat16"`` (every weight dequantized to that dtype).

    Raises:
        ValueError: a mode outside :data:`WEIGHT_MODES`.
    """
    if mode not in WEIGHT_MODES:
        raise ValueError(f"weights mode {mode!r}: must be one of {', '.join(WEIGHT_MODES)}")
    if mode == "auto":
        return "native" if torch.device(device).type == "cpu" else "float32"
    return mode


def _linear(parts: list, native: bool, dtype: torch.dtype, device: torch.device) -> QuantLinear:
    """One linear over ``parts`` stacked along the output dim (fused QKV, gate-up). Natively: int4 when every part
    is Q4 groups, int8 when every part is int8 groups, int8h when the parts are half-scaled int8 groups or a
    mix (Q4_K_M's, e.g. Q5_0 Q/K with a Q8_0 V; each with its float32 copy for large batches); anything else is
    dequantized into a dense ``dtype`` weight."""
    if native and all(isinstance(p, Int4Groups) for p in parts):
        return QuantLinear.int4(Int4Groups.cat(parts))
    if native and all(isinstance(p, Int8Groups) for p in parts):
        return QuantLinear.int8(Int8Groups.cat(parts))
    if native and all(isinstance(p, (Int4Groups, Int8Groups, Int8HalfGroups)) for p in parts):
        return QuantLinear.int8h(Int8HalfGroups.cat(parts))   # K-quants, Q5, mixes (converted exactly)
    dense = [p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts]
    return QuantLinear.dense(torch.cat([d.to(device=device, dtype=dtype) for d in dense]))


class LlamaModel:
    """A decoder of any family in gpu/families.py (the name is historical) that reads and writes a caller-owned
    paged KV pool.

    Args:
        config: from :func:`gpu.loader.load_weights`.
        weights: HF-named weights from :func:`gpu.loader.load_weights`: tensors (their dtype becomes the compute
            dtype unless ``native``), or with ``native`` also :class:`gpu.quant.Int4Groups` /
            :class:`gpu.quant.Int8Groups` / :class:`gpu.quant.Int8HalfGroups` for GGUF-quantized linears, kept
            packed.
        device: where the weights (and every ``kv`` pool passed in) live.
        native: run packed weights with gpu/lowbit_cpu.py's GEMV (``weights="auto"`` in the engine) when a
            prefill has fewer than ``dense_min_tokens`` tokens, their float32 copies otherwise (every prefill by
            default); decode steps of fewer than ``decode_stacked_max_rows`` rows run the GEMV too, every layer in
            one numba call (``lowbit_cpu.decode_layers``) where the layer is Llama's, op by op otherwise; a decode
            step's output projection runs low-bit below
            ``head_dense_min_rows`` rows, a prefill's as its layers do; activations stay float32. False = the
            dense path in the tensors' dtype.

    Calls keep no per-request state (the pool holds it all). ``prefill``/``decode`` run under
    ``torch.inference_mode()``, so the logits they return are inference tensors: modify them in place only
    inside ``torch.inference_mode()`` (or work on a copy made there).
    """

    def __init__(self, config: ModelConfig, weights: dict[str, Any],
                 device: str | torch.device = "cpu", native: bool = False):
        if native and torch.device(device).type != "cpu":
            raise ValueError("native low-bit weights run on CPU only; use float32 or bfloat16 on other devices")
        embed = weights["model.embed_tokens.weight"]
        dtype = torch.float32 if native else embed.dtype
        dev = torch.device(device)

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=dev, dtype=dtype).contiguous()

        def lin(*names: str) -> QuantLinear:
            return _linear([weights[n] for n in names], native, dtype, dev)

        fam = config.spec

        def norm(name: str) -> torch.Tensor:  # the scale RMSNorm multiplies by: offset + w (Gemma: 1 + w)
            return (weights[name].to(device=dev, dtype=torch.float32) + fam.norm_offset).to(dtype).contiguous()

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            sparse = bool(config.moe_layers) and config.moe_layers[i]
            layer = _Layer(
                ln_attn=norm(p + "input_layernorm.weight"),
                qkv=lin(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
                o=lin(p + "self_attn.o_proj.weight"),
                ln_mlp=norm(p + ("pre_feedforward_layernorm.weight" if fam.sandwich_norms
                                 else "post_attention_layernorm.weight")),
                gate_up=None if sparse else lin(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=None if sparse else lin(p + "mlp.down_proj.weight"),
            )
            if sparse:
                layer.router = weights[p + "mlp.gate.weight"].to(device=dev, dtype=torch.float32).contiguous()
                layer.experts = [(lin(p + f"mlp.experts.{e}.gate_proj.weight", p + f"mlp.experts.{e}.up_proj.weight"),
                                  lin(p + f"mlp.experts.{e}.down_proj.weight")) for e in range(config.num_experts)]
            if fam.qkv_bias:
                layer.qkv_bias = torch.cat([w(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            if fam.qk_norm:
                layer.q_norm, layer.k_norm = norm(p + "self_attn.q_norm.weight"), norm(p + "self_attn.k_norm.weight")
            if fam.sandwich_norms:
                layer.post_attn = norm(p + "post_attention_layernorm.weight")
                layer.post_mlp = norm(p + "post_feedforward_layernorm.weight")
            layers.append(layer)
        if native:  # int8 groups (a tied output projection shares them) + the float32 table for lookups
            rows = embed if isinstance(embed, Int8Groups) else int8_groups_from_float(
                embed if isinstance(embed, torch.Tensor) else embed.dequantize())
            embedding = QuantLinear.int8(rows)
        else:
            embedding = QuantLinear.dense(w("model.embed_tokens.weight"))
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        lm_head = embedding if tied else lin("lm_head.weight")
        if native and lm_head.kind == "dense":  # int8 groups as the embedding's (a dense one would run row by row)
            lm_head = QuantLinear.int8(int8_groups_from_float(lm_head.tensors["weight"]))
        self._setup(config, dev, dtype, native, embedding, lm_head, norm("model.norm.weight"), layers,
                    rope_inv_freq(config, weights.get("rope_freqs")))

    def _setup(self, config: ModelConfig, device: torch.device, dtype: torch.dtype, native: bool,
               embedding: QuantLinear, lm_head: QuantLinear, norm: torch.Tensor, layers: list[_Layer],
               inv_freq: torch.Tensor) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype  # activations (and dense weights)
        self.native = native
        # a forward of at least this many tokens runs each linear's float32 weight (``QuantLinear.big``)
        self.dense_min_tokens = DENSE_MIN_TOKENS
        # natively, a prefill's output projection runs its float32 copy as the layers do (_gemm_rows; echo's prompt
        # scores); the engine's prompts take their first token from a decode step instead
        self.prefill_head_dense = True
        # natively, the engine (actors/model_runner.PrefillRunner) runs a prompt's last token as a decode step: a
        # prompt whose prefix is cached then pays the low-bit GEMVs, not a float32 block per linear
        self.prompt_last_by_decode = native
        self._gemm_threads = 0   # torch threads of a native prefill's float32 GEMMs (prefill_packed's gemm_threads)
        self._gemm_plans: dict[tuple[int, int, int], tuple[bool, int]] = {}   # (out, in, threads): gemm_plan's
        self.head_dense_min_rows = HEAD_DENSE_MIN_ROWS  # the same for the output projection
        # decode steps below this run the GEMV (decode_layers where it applies), at or above it the float32 copies
        self.decode_stacked_max_rows = DECODE_STACKED_MAX_ROWS
        self.embedding = embedding  # [vocab, hidden]: a dense weight, or int8 groups (native)
        self.lm_head = lm_head  # [vocab, hidden]; the embedding itself when tied
        self.norm = norm  # [hidden]
        self.layers = layers
        self._inv_freq = inv_freq  # [head_dim // 2] float32, cpu
        # sliding layers with their own RoPE base (Gemma 3) read the local tables, unscaled
        self._windows = list(config.layer_windows) or [0] * config.num_layers  # per layer, 0 = global
        self._local_rope = [config.local_rope_theta is not None and wnd > 0 for wnd in self._windows]
        self._inv_freq_local = None if config.local_rope_theta is None else rope_inv_freq(
            dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None))
        self._rope_len = 0
        self._cos = self._sin = self._cos_local = self._sin_local = torch.empty(0)
        self._ensure_rope(min(config.max_position_embeddings, 4096))
        self._scale = config.attn_scale or 1.0 / math.sqrt(config.head_dim)
        self._embed_scale = math.sqrt(config.hidden_size) if config.spec.embed_scale else None
        self._silu = config.spec.activation == "silu"
        # the one-call low-bit decode (lowbit_cpu.decode_layers) computes Llama's layer exactly, nothing else
        self._llama_layers = (config.spec.llama_like and not any(self._windows) and config.attn_scale is None
                              and config.attn_softcap is None and config.final_softcap is None)
        self._stacked: tuple | None = None  # the Q4 layers stacked for lowbit_cpu.decode_layers (_stack_layers)

    @property
    def weights_mode(self) -> str:
        """``"native"``, ``"float32"`` or ``"bfloat16"``."""
        return "native" if self.native else str(self.dtype).removeprefix("torch.")

    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads (every layer's linears, the output projection, the norms)."""
        linears = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
                   if lin is not None]
        linears += [lin for layer in self.layers for pair in layer.experts or () for lin in pair]
        norms = [t for layer in self.layers for t in (layer.ln_attn, layer.ln_mlp) + tuple(
            getattr(layer, e) for e in _Layer.EXTRAS if getattr(layer, e) is not None)] + [self.norm]
        return sum(lin.weight_bytes for lin in linears + [self.lm_head]) + sum(
            t.numel() * t.element_size() for t in norms)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]`` in the activation dtype for ``ids`` ``[T]``."""
        t = self.embedding.tensors
        if "dense" in t or "weight" in t:  # a gather touches only these rows, even of a memory-mapped table
            x = F.embedding(ids, t.get("dense", t.get("weight")))
        else:
            from .lowbit_cpu import q8_rows  # noqa: PLC0415
            x = q8_rows(ids, t["tiles"], t["tile_scale"]).to(self.dtype)
        return x if self._embed_scale is None else x * self._embed_scale  # Gemma: times sqrt(hidden)

    # -- prepared state (gpu/prepared.py caches it on disk) ------------------------------------------------

    _LINEARS = ("qkv", "o", "gate_up", "down")

    def to_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The built model as ``(meta, tensors)``: JSON-able ``meta`` (config, mode, each linear's kind) and flat
        CPU ``tensors`` (packed weights as they run), so :meth:`from_state` rebuilds it without the model file."""
        tensors, kinds, outputs, put = self._state_writer()
        for i, layer in enumerate(self.layers):
            tensors[f"layers.{i}.ln_attn"], tensors[f"layers.{i}.ln_mlp"] = layer.ln_attn, layer.ln_mlp
            tensors.update({f"layers.{i}.{e}": getattr(layer, e) for e in _Layer.EXTRAS
                            if getattr(layer, e) is not None})
            for name in self._LINEARS:
                if getattr(layer, name) is not None:
                    put(f"layers.{i}.{name}", getattr(layer, name))
            if layer.router is not None:
                tensors[f"layers.{i}.router"] = layer.router
                for e, (gu, dn) in enumerate(layer.experts):
                    put(f"layers.{i}.experts.{e}.gate_up", gu)
                    put(f"layers.{i}.experts.{e}.down", dn)
        config = dataclasses.asdict(self.config)
        meta = {"config": config, "native": self.native, "dtype": str(self.dtype).removeprefix("torch."),
                "kinds": kinds, "out_features": outputs}
        return meta, tensors

    def _state_writer(self) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, int], Any]:
        """``(tensors, kinds, out_features, put)`` of :meth:`to_state`, holding the final norm, the RoPE table, the
        embedding and the LM head; ``put(name, linear)`` adds a linear."""
        tensors: dict[str, torch.Tensor] = {"norm": self.norm, "inv_freq": self._inv_freq}
        kinds: dict[str, str] = {}
        outputs: dict[str, int] = {}

        def put(name: str, lin: QuantLinear) -> None:
            kinds[name], outputs[name] = lin.kind, lin.out_features
            tensors.update({f"{name}.{k}": v for k, v in lin.tensors.items()})

        put("embedding", self.embedding)
        if self.lm_head is not self.embedding:
            put("lm_head", self.lm_head)
        return tensors, kinds, outputs, put

    @classmethod
    def from_state(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor],
                   device: str | torch.device = "cpu") -> "LlamaModel":
        """Rebuild a model from :meth:`to_state`'s output (tensors used as given, e.g. memory-mapped).

        Raises:
            KeyError, ValueError, TypeError: ``meta`` or ``tensors`` are incomplete or inconsistent.
        """
        cfg = dict(meta["config"])
        if cfg.get("rope_scaling") is not None:
            cfg["rope_scaling"] = RopeScaling(**cfg["rope_scaling"])
        cfg["eos_token_ids"] = tuple(cfg["eos_token_ids"])
        cfg["layer_windows"] = tuple(cfg.get("layer_windows", ()))
        cfg["moe_layers"] = tuple(cfg.get("moe_layers", ()))
        config = ModelConfig(**cfg)
        dev = torch.device(device)
        if meta.get("attention") == "mla":
            from .mla import MLAModel  # noqa: PLC0415
            return MLAModel._from_state(config, meta, tensors, dev)
        kinds = meta["kinds"]

        def lin(name: str) -> QuantLinear:
            prefix = name + "."
            return QuantLinear.from_tensors(kinds[name], {k[len(prefix):]: v.to(dev) for k, v in tensors.items()
                                                           if k.startswith(prefix)}, meta["out_features"][name])

        def extra(name: str) -> torch.Tensor | None:
            return tensors[name].to(dev) if name in tensors else None

        def experts(i: int) -> list | None:
            if f"layers.{i}.router" not in tensors:
                return None
            return [(lin(f"layers.{i}.experts.{e}.gate_up"), lin(f"layers.{i}.experts.{e}.down"))
                    for e in range(config.num_experts)]

        sparse = [f"layers.{i}.router" in tensors for i in range(config.num_layers)]
        layers = [_Layer(ln_attn=tensors[f"layers.{i}.ln_attn"].to(dev), qkv=lin(f"layers.{i}.qkv"),
                         o=lin(f"layers.{i}.o"), ln_mlp=tensors[f"layers.{i}.ln_mlp"].to(dev),
                         gate_up=None if sparse[i] else lin(f"layers.{i}.gate_up"),
                         down=None if sparse[i] else lin(f"layers.{i}.down"),
                         router=extra(f"layers.{i}.router"), experts=experts(i),
                         **{e: extra(f"layers.{i}.{e}") for e in _Layer.EXTRAS})
                  for i in range(config.num_layers)]
        embedding = lin("embedding")
        lm_head = lin("lm_head") if "lm_head" in kinds else embedding
        model = cls.__new__(cls)
        model._setup(config, dev, getattr(torch, meta["dtype"]), bool(meta["native"]), embedding, lm_head,
                     tensors["norm"].to(dev), layers, tensors["inv_freq"])
        return model

    @classmethod
    def from_path(cls, path: str | os.PathLike | None = None, device: str | torch.device = "cpu",
                  progress: bool = True, dtype: torch.dtype = torch.float32, weights: str = "") -> "LlamaModel":
        """Load weights with :func:`gpu.loader.load_weights` (None = the default model) and build the model
        (a :class:`gpu.mla.MLAModel` for a family with ``attention == "mla"``).

        ``weights``: ``"auto"``, ``"float32"`` or ``"bfloat16"`` (see :func:`resolve_weights_mode`); empty =
        dense in ``dtype``.

        Raises:
            ModelLoadError: see :func:`gpu.loader.load_weights`.
            ValueError: an unknown ``weights`` mode.
        """
        mode = resolve_weights_mode(weights, device) if weights else str(dtype).removeprefix("torch.")
        native = mode == "native"
        load_dtype = torch.float32 if native else getattr(torch, mode)
        config, tensors = load_weights(path, dtype=load_dtype, progress=progress, native=native)
        if config.spec.attention == "mla":  # multi-head latent attention (DeepSeek-V2): gpu/mla.py
            from .mla import MLAModel  # noqa: PLC0415
            return MLAModel(config, tensors, device=device, native=native)
        return cls(config, tensors, device=device, native=native)

    # -- RoPE tables -------------------------------------------------------------------------------------

    def _ensure_rope(self, n: int) -> None:
        """Make the cos/sin tables cover positions ``[0, n)``; grows by doubling."""
        if n <= self._rope_len:
            return
        n = max(n, 2 * self._rope_len)
        self._cos, self._sin = self._rope_tables(self._inv_freq, n)
        if self._inv_freq_local is not None:
            self._cos_local, self._sin_local = self._rope_tables(self._inv_freq_local, n)
        self._rope_len = n

    def _rope_tables(self, inv_freq: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``[n, head_dim]`` for positions ``[0, n)``."""
        t = torch.arange(n, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [n, head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [n, head_dim]
        half = self.config.head_dim // 2
        sin = emb.sin()
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: fold rotate_half's sign into the table.
        sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        return (emb.cos().to(device=self.device, dtype=self.dtype),  # [n, head_dim]
                sin_signed.to(device=self.device, dtype=self.dtype))  # [n, head_dim]

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [tokens, heads, head_dim]; cos, sin: [tokens, 1, head_dim]
        return x * cos + torch.roll(x, self.config.head_dim // 2, dims=-1) * sin

    # -- checks ------------------------------------------------------------------------------------------

    def _check_pool(self, kv: torch.Tensor) -> None:
        c = self.config
        if kv.dim() != 6 or kv.shape[0] != c.num_layers or kv.shape[1] != 2 or kv.shape[4] != c.num_kv_heads \
                or kv.shape[5] != c.head_dim:
            raise ValueError(
                f"kv pool has shape {list(kv.shape)}; expected [{c.num_layers}, 2, num_blocks, block_tokens, "
                f"{c.num_kv_heads}, {c.head_dim}]")
        if kv.device.type != self.device.type:
            raise ValueError(f"kv pool is on {kv.device}, the model on {self.device}")

    def _check_tokens(self, token_ids: list[int], last_pos: int) -> None:
        v = self.config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= v:
            raise ValueError(f"token ids must be in [0, {v}); got min {min(token_ids)}, max {max(token_ids)}")
        if last_pos >= self.config.max_position_embeddings:
            raise ValueError(f"position {last_pos} is past the model's context length "
                             f"{self.config.max_position_embeddings}")

    @staticmethod
    def _flat_pool(kv: torch.Tensor) -> torch.Tensor:
        """``kv`` viewed as ``[num_layers, 2, num_blocks * block_tokens, num_kv_heads, head_dim]`` (no copy).

        Slot ``block * block_tokens + offset`` then addresses a token, so reads and writes are one
        ``index_select`` / ``index_copy_`` each (advanced indexing over two dims is ~1000x slower on CPU).
        """
        L, two, nb, bt, hkv, d = kv.shape
        try:
            return kv.view(L, two, nb * bt, hkv, d)
        except RuntimeError:
            raise ValueError("kv pool's block and token dims must be mergeable (a contiguous pool, or a view "
                             f"of one); got strides {kv.stride()}") from None

    # -- forward -----------------------------------------------------------------------------------------

    def _prefill_table(self, kv: torch.Tensor, token_ids: list[int], block_table: list[int],
                       start_pos: int) -> list[int]:
        """Validate a prefill's arguments (see ``prefill``'s Raises) and return the block ids positions
        ``0 .. start_pos + len(token_ids) - 1`` use; extends the RoPE tables to cover them."""
        T = len(token_ids)
        if T == 0:
            raise ValueError("prefill needs at least one token")
        if start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        self._check_pool(kv)
        end = start_pos + T  # exclusive
        self._check_tokens(token_ids, end - 1)
        bt_size = kv.shape[3]
        n_blocks = (end - 1) // bt_size + 1
        if len(block_table) < n_blocks:
            raise ValueError(f"block table has {len(block_table)} blocks; positions 0..{end - 1} need "
                             f"{n_blocks} of {bt_size} tokens")
        table = block_table[:n_blocks]
        if min(table) < 0 or max(table) >= kv.shape[2]:
            raise ValueError(f"block ids must be in [0, {kv.shape[2]}); got {table}")
        self._ensure_rope(end)
        return table

    def _decode_tables(self, kv: torch.Tensor, token_ids: list[int], positions: list[int],
                       block_tables: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        """Validate a decode step's arguments (see ``decode``'s Raises); returns each sequence's block table
        padded to the longest (with its first block: masked keys then read finite, written values) and the
        block each new token is written to. Extends the RoPE tables to the longest position."""
        B = len(token_ids)
        if B == 0 or len(positions) != B or len(block_tables) != B:
            raise ValueError(f"decode needs equal, non-zero numbers of token_ids ({B}), positions "
                             f"({len(positions)}) and block_tables ({len(block_tables)})")
        self._check_pool(kv)
        max_pos = max(positions)
        if min(positions) < 0:
            raise ValueError(f"positions must be >= 0, got {positions}")
        self._check_tokens(token_ids, max_pos)
        bt_size, n_pool = kv.shape[3], kv.shape[2]
        n_blk = max_pos // bt_size + 1
        padded: list[list[int]] = []
        w_blk_l: list[int] = []
        for b in range(B):
            p, tbl = positions[b], block_tables[b]
            need = p // bt_size + 1
            if len(tbl) < need:
                raise ValueError(f"sequence {b}: block table has {len(tbl)} blocks; position {p} "
                                 f"needs {need}")
            used = tbl[:need]
            if min(used) < 0 or max(used) >= n_pool:
                raise ValueError(f"sequence {b}: block ids must be in [0, {n_pool}); got {used}")
            padded.append(used + [used[0]] * (n_blk - need))
            w_blk_l.append(used[-1])
        self._ensure_rope(max_pos + 1)
        return padded, w_blk_l

    @torch.inference_mode()
    def prefill(self, kv: torch.Tensor, token_ids: list[int], block_table: list[int], *, start_pos: int = 0,
                all_logits: bool = False) -> torch.Tensor:
        """Run one sequence's tokens at positions ``start_pos .. start_pos + len(token_ids) - 1``.

        Writes their K/V into ``kv`` at the slots ``block_table`` maps them to, and attends causally over
        positions ``0 ..`` (positions ``< start_pos`` are read from the pool: chunked prefill / prefix reuse).
        A one-sequence :meth:`prefill_packed`.

        Args:
            kv: ``[num_layers, 2, num_blocks, block_tokens, num_kv_heads, head_dim]`` pool on the model's
                device.
            token_ids: ``T >= 1`` ids.
            block_table: block ids of this sequence, covering at least ``start_pos + T`` positions.
            start_pos: position of ``token_ids[0]``.
            all_logits: return every position's logits instead of the last one's.
        Returns:
            float32 logits ``[vocab]`` of the last token, or ``[T, vocab]`` when ``all_logits``.
        Raises:
            ValueError: empty ``token_ids``, an id outside the vocabulary, a block table too short or with ids
                outside the pool, a position past the context length, or a pool of the wrong shape.
        """
        return self.prefill_packed(kv, [token_ids], [block_table], [start_pos], [all_logits])[0]

    @torch.inference_mode()
    def prefill_packed(self, kv: torch.Tensor, token_ids: list[list[int]], block_tables: list[list[int]],
                       start_positions: list[int], all_logits: list[bool] | None = None,
                       logits: list[bool] | None = None, gemm_threads: int = 0) -> list[torch.Tensor | None]:
        """Prefill ``B`` sequences (or chunks of them) in one forward pass (varlen packing, as vLLM and
        SGLang pack prefills): their ``N = sum(T_b)`` tokens are concatenated, so every linear layer runs once
        over ``[N, hidden]``; attention runs per sequence over its own causal context (block-diagonal),
        sequence ``b`` at positions ``start_positions[b] ..`` reading positions before that from its blocks.

        Args:
            kv: the pool (see :meth:`prefill`).
            token_ids: ``B`` lists of ``T_b >= 1`` ids.
            block_tables: ``B`` block-id lists, list ``b`` covering ``start_positions[b] + T_b`` positions.
                Sequences must not share the blocks they write.
            start_positions: ``[B]`` position of each list's first id.
            all_logits: ``[B]`` flags: sequence ``b`` gets every position's logits (default: none does).
            logits: ``[B]`` flags: False = sequence ``b`` needs no logits unless ``all_logits[b]`` (a chunk
                before its prompt's end; default: every sequence gets them).
            gemm_threads: > 0: a native model's float32 GEMMs run on that many torch threads where
                :func:`gemm_plan` finds they give a row the bits of one thread (one thread otherwise), every other
                op on torch's count as set (an activation over all the pass's rows splits where the threads do, and
                its bits then differ); 0 or a model that is not native: torch's count as set.
        Returns:
            ``B`` items: float32 ``[T_b, vocab]`` where ``all_logits[b]``, else the last token's ``[vocab]``, or
            None where ``logits[b]`` is False.
        Raises:
            ValueError: mismatched list lengths, no sequences, or any sequence's bad argument (see
                :meth:`prefill`).
        """
        self._gemm_threads = gemm_threads
        try:
            return self._prefill_packed(kv, token_ids, block_tables, start_positions, all_logits, logits)
        finally:
            self._gemm_threads = 0

    def _prefill_packed(self, kv: torch.Tensor, token_ids: list[list[int]], block_tables: list[list[int]],
                        start_positions: list[int], all_logits: list[bool] | None,
                        logits: list[bool] | None) -> list[torch.Tensor | None]:
        c = self.config
        flags, seqs, w_slot, pos, tables = self._packed_start(kv, token_ids, block_tables, start_positions,
                                                              all_logits)
        N = sum(len(ids) for ids in token_ids)
        kv_flat = self._flat_pool(kv)  # [L, 2, slots, Hkv, D]
        rope = self._rope_at(pos)
        # natively each token attends over its own keys (_attend_rows): the same KV however the prompt is packed
        # or cached
        rows_at = self._row_layout(kv, seqs, w_slot, pos, tables) if self.native else None

        ids = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long, device=self.device)
        x = self._embed(ids)  # x: [N, hidden]
        big = N >= self.dense_min_tokens
        eps = c.rms_norm_eps
        for li, layer in enumerate(self.layers):
            h = F.rms_norm(x, (c.hidden_size,), layer.ln_attn, eps)  # h: [N, hidden]
            q, k, v = self._qkv(li, layer, h, rope, big)  # q: [N, H, D]; k, v: [N, Hkv, D]
            k_pool, v_pool = kv_flat[li, 0], kv_flat[li, 1]  # [slots, Hkv, D] each
            k_pool.index_copy_(0, w_slot, k.to(kv.dtype))
            v_pool.index_copy_(0, w_slot, v.to(kv.dtype))
            if rows_at is not None:
                o = self._attend_rows(q, k_pool, v_pool, rows_at, self._windows[li])  # o: [N, H D]
            else:
                o = self._attend_packed(q, k, v, k_pool, v_pool, seqs, self._windows[li])  # o: [N, H D]
            x = self._layer_rest(layer, x, o, big)  # x: [N, hidden]
        return self._packed_logits(x, seqs, flags, big, logits)

    def _packed_start(self, kv: torch.Tensor, token_ids: list[list[int]], block_tables: list[list[int]],
                      start_positions: list[int], all_logits: list[bool] | None) -> tuple:
        """:meth:`prefill_packed`'s arguments checked (its ValueErrors) and laid out: ``(flags, seqs, w_slot, pos,
        tables)``, the ``all_logits`` flags ``[B]``, :meth:`_packed_layout`'s index tensors and the checked block
        tables."""
        B = len(token_ids)
        flags = [False] * B if all_logits is None else list(all_logits)
        if B == 0 or len(block_tables) != B or len(start_positions) != B or len(flags) != B:
            raise ValueError(f"prefill_packed needs equal, non-zero numbers of token_ids ({B}), block_tables "
                             f"({len(block_tables)}), start_positions ({len(start_positions)}) and all_logits")
        tables = [self._prefill_table(kv, ids, tbl, s) for ids, tbl, s in zip(token_ids, block_tables,
                                                                              start_positions)]
        return (flags, *self._packed_layout(kv, token_ids, tables, start_positions), tables)

    def _packed_logits(self, x: torch.Tensor, seqs: list[tuple], flags: list[bool], big: bool,
                       wanted: list[bool] | None = None) -> list[torch.Tensor | None]:
        """:meth:`prefill_packed`'s return from the last layer's output ``x`` ``[N, hidden]``: only the rows whose
        logits are asked for go through the norm and the LM head (``wanted``: its ``logits`` flags)."""
        wanted = [True] * len(seqs) if wanted is None else wanted
        rows = [range(a, b) if f else range(b - 1, b) if w else range(0) for (a, b, *_), f, w in
                zip(seqs, flags, wanted)]
        if not any(rows):
            return [None] * len(seqs)
        x = x[torch.tensor([i for r in rows for i in r], dtype=torch.long, device=self.device)]
        x = F.rms_norm(x, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)
        # the output projection follows the layers: float32 in every prefill by default (int8-rounded activations
        # flip near ties, SmolLM2's "The capital..." vs "L'..." by 0.09 logits, when every layer runs low-bit too)
        if self.native and self.prefill_head_dense:  # a row's bits whatever the rows beside it
            logits = self._gemm_rows(self.lm_head, x)
        else:
            logits = self._linear(self.lm_head, x, big)
        logits = self._softcap_logits(logits.float())  # [rows, vocab]
        parts = logits.split([len(r) for r in rows])
        return [part if f else part[0] if len(part) else None for part, f in zip(parts, flags)]

    def _packed_layout(self, kv: torch.Tensor, token_ids: list[list[int]], tables: list[list[int]],
                       start_positions: list[int]) -> tuple[list[tuple], torch.Tensor, torch.Tensor]:
        """Index tensors of a packed prefill. Returns ``seqs`` (per sequence: its rows ``a:b`` of the packed
        tokens, then None if it starts at position 0, else its context's pool slots ``[S]`` and causal mask
        ``[T, S]``, then its positions ``[T]``), the pool slot of every packed token ``[N]`` and every token's
        position ``[N]``."""
        bt_size, dev = kv.shape[3], self.device
        seqs, w_slots, positions = [], [], []
        a = 0
        for ids, table, start in zip(token_ids, tables, start_positions):
            end = start + len(ids)  # exclusive
            table_t = torch.tensor(table, dtype=torch.long, device=dev)  # [n_blocks]
            pos = torch.arange(start, end, device=dev)  # [T]
            w_slots.append(table_t[pos // bt_size] * bt_size + pos % bt_size)  # [T] slot of each new token
            positions.append(pos)
            r_slot = mask = None
            if start > 0:
                ctx = torch.arange(end, device=dev)  # [S]
                r_slot = table_t[ctx // bt_size] * bt_size + ctx % bt_size  # [S]
                # mask[i, j]: the query at position start + i sees the key at position j <= start + i
                mask = ctx[None, :] <= pos[:, None]  # [T, S]
            seqs.append((a, a + len(ids), r_slot, mask, pos))
            a += len(ids)
        return seqs, torch.cat(w_slots), torch.cat(positions)

    def _row_layout(self, kv: torch.Tensor, seqs: list[tuple], w_slot: torch.Tensor, pos: torch.Tensor,
                    tables: list[list[int]]) -> tuple:
        """What :meth:`_attend_rows` needs of a packed prefill: for ``attention_cpu.attend_rows`` (a float32 pool,
        no soft-capping, a head dim it supports) the block tables int64 ``[B, blocks]`` (padded with their first
        block), each row's sequence and position int64 ``[N]`` and the pool's block size; else every sequence's
        context slots ``[S_b]`` for the per-token SDPA loop."""
        from . import attention_cpu  # noqa: PLC0415  (numba: only a native model's process imports it)

        if (kv.dtype == torch.float32 and self.dtype == torch.float32 and self.config.attn_softcap is None
                and attention_cpu.supported(kv.shape[-1])):
            width = max(len(t) for t in tables)
            padded = np.asarray([t + [t[0]] * (width - len(t)) for t in tables], np.int64)
            seq = np.repeat(np.arange(len(seqs), dtype=np.int64), [b - a for a, b, *_ in seqs])
            return "kernel", padded, seq, pos.numpy().astype(np.int64), kv.shape[3]
        return "sdpa", [w_slot[a:b] if r_slot is None else r_slot for a, b, r_slot, *_ in seqs], seqs, pos

    def _attend_rows(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows_at: tuple,
                     window: int) -> torch.Tensor:
        """Causal attention of every packed row on its own, over its own sequence's keys in the pool (already
        written): a row's bits then depend on its query and keys only, not on the rows packed with it or on how
        many of its keys an earlier prefill wrote. q ``[N, H, D]``, the pools ``[slots, Hkv, D]``, ``rows_at``
        from :meth:`_row_layout`. Returns ``[N, H D]``."""
        N = q.shape[0]
        if rows_at[0] == "kernel":
            from . import attention_cpu  # noqa: PLC0415

            _, tables, seq, pos, block_tokens = rows_at
            out = np.empty(q.shape, np.float32)
            attention_cpu.attend_rows(q.contiguous().numpy(), k_pool.numpy(), v_pool.numpy(), tables, block_tokens,
                                      seq, pos, window, np.float32(self._scale), out)
            return torch.from_numpy(out).view(N, -1)
        _, seq_slots, seqs, pos = rows_at
        return torch.cat([self._attend_row(q[i:i + 1], k_pool, v_pool, slots[:p + 1], window)
                          for (a, b, *_), slots in zip(seqs, seq_slots)
                          for i, p in zip(range(a, b), pos[a:b].tolist())]).reshape(N, -1)

    def _attend_packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                       v_pool: torch.Tensor, seqs: list[tuple], window: int = 0) -> torch.Tensor:
        """Causal attention of each packed sequence over its own context; q ``[N, H, D]``, k/v ``[N, Hkv, D]``
        (already written to ``k_pool``/``v_pool`` ``[slots, Hkv, D]``); ``window`` > 0: a query at position ``p``
        sees keys at ``p - window < j <= p`` only. Returns ``[N, H * D]``."""
        pool_dtype = k_pool.dtype
        outs = []
        for a, b, r_slot, mask, pos in seqs:
            qh = q[a:b].transpose(0, 1).unsqueeze(0).contiguous()  # qh: [1, H, T, D]
            if r_slot is None:
                # The values the pool now holds (rounded through the pool dtype when it differs).
                kc = k[a:b].to(pool_dtype).to(self.dtype).transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hkv, T, D]
                vc = v[a:b].to(pool_dtype).to(self.dtype).transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hkv, T, D]
                ctx = pos  # the sequence starts at position 0: its keys are its own tokens
                mask = (ctx[None, :] <= pos[:, None]) if window else None  # [T, T]
            else:
                kc = k_pool.index_select(0, r_slot).to(self.dtype).transpose(0, 1).unsqueeze(0).contiguous()
                vc = v_pool.index_select(0, r_slot).to(self.dtype).transpose(0, 1).unsqueeze(0).contiguous()
                # kc, vc: [1, Hkv, S, D]
                ctx = torch.arange(kc.shape[2], device=self.device)  # [S]
            if window:
                mask = mask & (ctx[None, :] > pos[:, None] - window)  # [T, S]
            o = self._attention(qh, kc, vc, mask, causal=r_slot is None)  # o: [1, H, T, D]
            outs.append(o[0].transpose(0, 1).reshape(b - a, -1))  # [T, H D]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   causal: bool = False) -> torch.Tensor:
        """Grouped-query attention: q ``[B, H, T, D]``, k/v ``[B, Hkv, S, D]``, ``mask`` bool broadcasting to
        ``[B, H, T, S]`` (True = attend) or None: every key, or with ``causal`` (``S == T``) the causal ones.
        Scores are ``q.k * attn_scale``, soft-capped as ``cap * tanh(s / cap)`` when the config has
        ``attn_softcap`` (as HF's eager attention). Returns ``[B, H, T, D]``."""
        cap = self.config.attn_softcap
        if cap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                                  scale=self._scale, enable_gqa=True)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [B, H, S, D]
        s = torch.matmul(q, k.transpose(-1, -2)) * self._scale  # s: [B, H, T, S]
        s = torch.tanh(s / cap) * cap
        if mask is None and causal:
            T, S = s.shape[-2:]
            mask = torch.ones(T, S, dtype=torch.bool, device=s.device).tril(S - T)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)

    # -- one layer's parts, shared by prefill and decode ---------------------------------------------------

    def _rope_at(self, pos: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin ``[N, 1, D]`` at positions ``pos`` ``[N]``: key True = the local tables (Gemma 3's sliding
        layers), False = the global ones."""
        out = {False: (self._cos[pos].unsqueeze(1), self._sin[pos].unsqueeze(1))}
        if self._inv_freq_local is not None:
            out[True] = (self._cos_local[pos].unsqueeze(1), self._sin_local[pos].unsqueeze(1))
        return out

    def _qkv(self, li: int, layer: _Layer, h: torch.Tensor, rope: dict, big: bool) -> tuple[torch.Tensor, ...]:
        """Q ``[N, H, D]``, K ``[N, Hkv, D]`` (biased, per-head normed, rotated) and V ``[N, Hkv, D]`` of layer
        ``li`` from its normed input ``h`` ``[N, hidden]``."""
        c = self.config
        N, H, Hkv, D = h.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        qkv = self._linear(layer.qkv, h, big)  # qkv: [N, (H + 2 Hkv) D]
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        qk = qkv[:, :(H + Hkv) * D].view(N, H + Hkv, D)
        if layer.q_norm is not None:
            qk = torch.cat([F.rms_norm(qk[:, :H], (D,), layer.q_norm, c.rms_norm_eps),
                            F.rms_norm(qk[:, H:], (D,), layer.k_norm, c.rms_norm_eps)], dim=1)
        cos, sin = rope[self._local_rope[li]]
        qk = self._rope(qk, cos, sin)  # qk: [N, H + Hkv, D]
        return qk[:, :H], qk[:, H:], qkv[:, (H + Hkv) * D:].view(N, Hkv, D)

    def _layer_rest(self, layer: _Layer, x: torch.Tensor, o: torch.Tensor, big: bool) -> torch.Tensor:
        """The layer after attention: ``x`` ``[N, hidden]`` (updated in place) plus the output projection of
        ``o`` ``[N, H D]`` (post-normed with sandwich norms), then plus the gated MLP of its pre-normed sum."""
        c = self.config
        hidden, eps = (c.hidden_size,), c.rms_norm_eps
        a = self._linear(layer.o, o, big)
        if layer.post_attn is not None:
            a = F.rms_norm(a, hidden, layer.post_attn, eps)
        x.add_(a)
        h = F.rms_norm(x, hidden, layer.ln_mlp, eps)
        m = self._mlp(layer.gate_up, layer.down, h, big) if layer.router is None else self._moe(layer, h, big)
        if layer.post_mlp is not None:
            m = F.rms_norm(m, hidden, layer.post_mlp, eps)
        return x.add_(m)

    def _mlp(self, gate_up: QuantLinear, down: QuantLinear, h: torch.Tensor, big: bool) -> torch.Tensor:
        """The gated MLP ``down(act(gate(h)) * up(h))``: ``h`` ``[N, hidden]`` -> ``[N, hidden]``."""
        gate, up = self._linear(gate_up, h, big).chunk(2, dim=-1)  # [N, I] each
        act = F.silu(gate) if self._silu else F.gelu(gate, approximate="tanh")
        return self._linear(down, act * up, big)

    def _linear(self, lin: QuantLinear, x: torch.Tensor, big: bool) -> torch.Tensor:
        """``lin`` over ``x`` ``[N, K]`` -> ``[N, out]``: its float32 copy when ``big``, else its own kernel. Natively
        a dense weight then runs row by row, so a decode row gets the bits it gets alone, as from the low-bit GEMVs
        (MKL's GEMM sums a row in another order in calls of 1 to 3 rows than in larger ones: `python -m
        bench.prefill_forward`)."""
        if big and self.native:  # the bits of a PREFILL_BLOCK_ROWS-row call (see there)
            return self._gemm_rows(lin, x)
        if big:
            return lin.big(x)
        if self.native and lin.kind == "dense" and x.shape[0] > 1:
            return torch.cat([lin.fn(x[i:i + 1]) for i in range(x.shape[0])])
        return lin.fn(x)

    def _gemm_rows(self, lin: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """``lin``'s float32 copy over ``x`` ``[n, K]`` -> ``[n, out]`` with the bits of a PREFILL_BLOCK_ROWS-row
        call on one thread (:func:`gemm_rows` by :func:`gemm_plan`, found once per shape and thread count), on
        ``prefill_packed``'s ``gemm_threads`` where the plan allows."""
        threads = self._gemm_threads or torch.get_num_threads()
        key = (lin.out_features, x.shape[1], threads)
        if key not in self._gemm_plans:
            self._gemm_plans[key] = gemm_plan(lin.big, x.shape[1], threads)
        whole, threads = self._gemm_plans[key]
        return gemm_rows(lin.big, x, whole, threads)

    def _moe(self, layer: _Layer, h: torch.Tensor, big: bool) -> torch.Tensor:
        """A sparse layer's MLP (Qwen3-MoE, as HF's ``Qwen3MoeSparseMoeBlock``): softmax over the router's
        logits, the top ``experts_per_token`` per token (renormalised when ``norm_topk_prob``); each chosen expert
        runs once over its own tokens only and adds its weighted output. ``h`` ``[N, hidden]`` -> ``[N, hidden]``."""
        c = self.config
        probs = torch.softmax(self._linear(QuantLinear.dense(layer.router), h.float(), big), dim=-1)  # [N, E]
        weight, chosen = torch.topk(probs, c.experts_per_token, dim=-1)  # [N, k] each
        if c.norm_topk_prob:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        weight = weight.to(h.dtype)
        out = torch.zeros_like(h)
        for e in chosen.unique().tolist():  # ascending, as HF adds them
            rows, slot = (chosen == e).nonzero(as_tuple=True)  # the tokens routed to e, and where in their top-k
            gate_up, down = layer.experts[e]
            y = self._mlp(gate_up, down, h[rows], big and len(rows) >= self.dense_min_tokens)
            out.index_add_(0, rows, y * weight[rows, slot, None])
        return out

    def _attend_row(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, r_slot: torch.Tensor,
                    window: int) -> torch.Tensor:
        """One decode row's attention over exactly its own keys (as a decode step of that row alone computes it):
        q ``[1, H, D]``, the pools ``[slots, Hkv, D]``, ``r_slot`` ``[S]`` the slots of its positions ``0 .. S - 1``
        (the last one its new token). Returns ``[1, H, 1, D]``."""
        c = self.config
        S = r_slot.shape[0]
        kc = k_pool.index_select(0, r_slot).to(self.dtype).view(1, S, c.num_kv_heads, c.head_dim).transpose(1, 2)
        vc = v_pool.index_select(0, r_slot).to(self.dtype).view(1, S, c.num_kv_heads, c.head_dim).transpose(1, 2)
        mask = None  # kc, vc: [1, Hkv, S, D]
        if window:
            mask = (torch.arange(S, device=self.device) > S - 1 - window)[None, None, None, :]  # [1, 1, 1, S]
        return self._attention(q.unsqueeze(2), kc, vc, mask)

    def _softcap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``cap * tanh(logits / cap)`` when the config has ``final_softcap`` (Gemma 2), else ``logits``."""
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _stack_layers(self) -> tuple | None:
        """Every layer's norms and Q4 tiles stacked along a new first axis (numpy, for
        ``lowbit_cpu.decode_layers``), built once; the layers' own linears then run on views of the stacks, so
        the tiles are not held twice. None unless native with every layer linear in Q4 or Q8h tiles (K-quants:
        a linear whose layers mix the two is stacked as Q8h, its Q4 layers converted exactly)."""
        names, keys = ("qkv", "o", "gate_up", "down"), ("tiles", "tile_scale", "tile_min")
        if self._stacked is None:
            if not self.native or not self._llama_layers or any(
                    getattr(lay, n).kind not in ("int4", "int8h") for lay in self.layers for n in names):
                self._stacked = ()
                return None
            from .lowbit_cpu import q4_to_q8h_tiles  # noqa: PLC0415

            stacks = {}
            for n in names:
                lins = [getattr(lay, n) for lay in self.layers]
                if any(lin.kind == "int8h" for lin in lins):
                    lins = [lin if lin.kind == "int8h" else QuantLinear(
                        "int8h", q4_to_q8h_tiles(*(lin.tensors[k] for k in keys)) | (
                            {"dense": lin.tensors["dense"]} if "dense" in lin.tensors else {}), lin.out_features)
                            for lin in lins]
                parts = {k: torch.stack([lin.tensors[k] for lin in lins]) for k in keys}
                for li, (lay, lin) in enumerate(zip(self.layers, lins)):
                    own = {k: lin.tensors[k] for k in lin.tensors if k not in parts} | {k: v[li] for k, v in
                                                                                          parts.items()}
                    setattr(lay, n, QuantLinear(lin.kind, own, lin.out_features))
                stacks[n] = tuple(parts[k].numpy() for k in keys)
            norms = [torch.stack([getattr(lay, n) for lay in self.layers]).numpy() for n in ("ln_attn", "ln_mlp")]
            self._stacked = (*norms, *(stacks[n] for n in names))
        return self._stacked or None

    def _decode_stacked(self, kv: torch.Tensor, token_ids: list[int], positions: list[int], padded: list[list[int]],
                        stacked: tuple) -> torch.Tensor:
        """``decode`` through ``lowbit_cpu.decode_layers`` (one numba call for all layers): logits ``[B, vocab]``."""
        from .lowbit_cpu import decode_layers, threads  # noqa: PLC0415
        c = self.config
        x = self._embed(torch.tensor(token_ids, dtype=torch.long))  # [B, hidden], fresh: updated in place
        decode_layers(x.numpy(), *stacked, self._flat_pool(kv).numpy(), kv.shape[3], np.asarray(padded, np.int64),
                      np.asarray(positions, np.int64), self._cos.numpy(), self._sin.numpy(), c.num_heads,
                      c.intermediate_size, c.rms_norm_eps, self._scale, threads() > 1)
        x = F.rms_norm(x, (c.hidden_size,), self.norm, c.rms_norm_eps)
        return self._softcap_logits(self._linear(self.lm_head, x, len(token_ids) >= self.head_dense_min_rows).float())

    @torch.inference_mode()
    def decode(self, kv: torch.Tensor, token_ids: list[int], positions: list[int],
               block_tables: list[list[int]]) -> torch.Tensor:
        """One decode step for ``B`` sequences at once (continuous batching).

        Sequence ``b`` feeds ``token_ids[b]`` at position ``positions[b]``: its K/V is written to the pool,
        and it attends over positions ``0 .. positions[b]`` of its own blocks (``block_tables[b]``). Linear
        layers run once over the whole batch; attention gathers each sequence's context from the pool,
        padded to the longest with a mask.

        Args:
            kv: ``[num_layers, 2, num_blocks, block_tokens, num_kv_heads, head_dim]`` pool.
            token_ids: ``[B]`` one new id per sequence.
            positions: ``[B]`` position of each new token (= tokens already in the cache for it).
            block_tables: ``B`` block-id lists, each covering at least ``positions[b] + 1`` positions.
        Returns:
            float32 logits ``[B, vocab]``.
        Raises:
            ValueError: mismatched lengths, an id outside the vocabulary, a negative position, a position
                past the context length, or a block table too short or with ids outside the pool.
        """
        c = self.config
        B = len(token_ids)
        padded, w_blk_l = self._decode_tables(kv, token_ids, positions, block_tables)
        if B < self.decode_stacked_max_rows and kv.dtype == torch.float32 and (stacked := self._stack_layers()):
            return self._decode_stacked(kv, token_ids, positions, padded, stacked)
        bt_size = kv.shape[3]
        S = max(positions) + 1  # keys per sequence after padding
        dev = self.device
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim

        kv_flat = self._flat_pool(kv)  # [L, 2, slots, Hkv, D]
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)  # [B]
        w_slot = torch.tensor(w_blk_l, dtype=torch.long, device=dev) * bt_size + pos_t % bt_size  # [B]
        ctx = torch.arange(S, device=dev)  # [S]
        r_blk = torch.tensor(padded, dtype=torch.long, device=dev)[:, ctx // bt_size]  # [B, S]
        valid = ctx[None, :] <= pos_t[:, None]  # [B, S]
        if min(positions) == S - 1:  # every sequence has the same length: no padding, no mask
            masks = {0: None}
            r_slot = (r_blk * bt_size + ctx % bt_size).reshape(-1)  # [B S]
        else:
            # Padded keys read slot (block, 0) of their own sequence: written, so finite under the mask.
            r_slot = (r_blk * bt_size + torch.where(valid, ctx % bt_size, 0)).reshape(-1)  # [B S]
            masks = {0: valid[:, None, None, :]}  # [B, 1, 1, S]
        for wnd in set(self._windows) - {0}:  # sliding layers: keys p - window < j <= p
            masks[wnd] = (valid & (ctx[None, :] > pos_t[:, None] - wnd))[:, None, None, :]  # [B, 1, 1, S]
        rope = self._rope_at(pos_t)

        ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        x = self._embed(ids)  # x: [B, hidden], a fresh tensor: the residual adds below run in place
        big = B >= self.decode_stacked_max_rows  # the float32 copies only where decode_layers would not run
        # low-bit rows are batch-invariant (lowbit_cpu's GEMVs); attention then runs per row over its own keys, as
        # SDPA over keys padded to the longest row sums them in another order (0.4 logits apart after 30 layers)
        per_row = self.native and not big and B > 1
        eps, hidden = c.rms_norm_eps, (c.hidden_size,)
        for li, layer in enumerate(self.layers):
            h = F.rms_norm(x, hidden, layer.ln_attn, eps)  # h: [B, hidden]
            q, k, v = self._qkv(li, layer, h, rope, big)  # q: [B, H, D]; k, v: [B, Hkv, D]
            k_pool, v_pool = kv_flat[li, 0], kv_flat[li, 1]  # [slots, Hkv, D] each
            k_pool.index_copy_(0, w_slot, k.to(kv.dtype))
            v_pool.index_copy_(0, w_slot, v.to(kv.dtype))
            if per_row:
                o = torch.cat([self._attend_row(q[b:b + 1], k_pool, v_pool, r_slot[b * S:b * S + p + 1],
                                                self._windows[li]) for b, p in enumerate(positions)])
            else:
                # strided views, no copies: SDPA gives the same bits as on contiguous K/V and is 10-40% cheaper
                kc = k_pool.index_select(0, r_slot).to(self.dtype).view(B, S, Hkv, D).transpose(1, 2)
                vc = v_pool.index_select(0, r_slot).to(self.dtype).view(B, S, Hkv, D).transpose(1, 2)
                # kc, vc: [B, Hkv, S, D]
                o = self._attention(q.unsqueeze(2), kc, vc, masks[self._windows[li]])  # o: [B, H, 1, D]
            x = self._layer_rest(layer, x, o.reshape(B, H * D), big)  # x: [B, hidden]
        x = F.rms_norm(x, hidden, self.norm, eps)
        return self._softcap_logits(self._linear(self.lm_head, x, B >= self.head_dense_min_rows).float())  # [B, vocab]


def from_path(path: str | os.PathLike | None = None, device: str | torch.device = "cpu",
              progress: bool = True, dtype: torch.dtype = torch.float32) -> LlamaModel:
    """Module-level alias of :meth:`LlamaModel.from_path`."""
    return LlamaModel.from_path(path, device=device, progress=progress, dtype=dtype)
