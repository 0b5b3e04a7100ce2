"""``LlamaModel``: a decoder of any family in gpu/families.py over a caller-owned paged KV cache, run by the
execution path chosen when it is built.

| module | what |
|---|---|
| gpu/model.py | :class:`LlamaModel` (weights, config, knobs, argument checks, block-table layouts, the public calls), pool sizing (:func:`kv_pool_shape`, :func:`kv_bytes_per_token`), weight modes, the CPU GEMM plan (:func:`gemm_plan`) |
| gpu/layers.py | the layer math every family shares (norms, RoPE, Q/K/V, attention's formula, MLP, MoE), weight building |
| gpu/mla.py | DeepSeek's multi-head latent attention and MoE (``MLAModel``) and its torch loops |
| gpu/exec_torch.py | ``TorchExecutor``: dense torch on any torch device (CPU float32/bfloat16, CUDA) |
| gpu/exec_lowbit.py | ``LowbitExecutor``: GGUF low-bit weights kept packed, on CPU (``weights="auto"``) |
| gpu/exec_cuda.py | ``CudaExecutor``: a torch CUDA device with the numba kernels of gpu/kernels (or the CUDA simulator) |
| gpu/prepared.py | the prepared-model cache and ``to_state`` / ``from_state`` |

The path is chosen once at load (``executor``: ``"auto"`` = ``"lowbit"`` for native weights, else ``"torch"``;
``"cuda"`` with ``attention_backend`` / ``linear_backend``, see gpu/exec_cuda.py) and kept in
``LlamaModel.executor``; every call goes to it. The computation is Hugging Face's (gpu/layers.py).

Paged KV cache (the layout of vLLM's PagedAttention, Kwon et al. 2023). The caller owns the pool::

    kv: [num_layers, 2, num_blocks, block_tokens, num_kv_heads, head_dim]     index 0 = K, 1 = V

A request's K/V for token position ``p`` lives at block ``block_table[p // block_tokens]``, offset
``p % block_tokens``. The model only writes the slots of the tokens it is given and only reads slots of
positions ``< position`` it attends to, so unwritten (even NaN) memory elsewhere in the pool is never read.
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from .exec_torch import TorchExecutor
from .layers import Layer, LayerMath, build_layers, rope_inv_freq
from .loader import ModelConfig, load_weights
from .model_files import WEIGHT_MODES, resolve_weights_mode
from .quant import QuantLinear

__all__ = ["EXECUTORS", "LlamaModel", "WEIGHT_MODES", "from_path", "kv_bytes_per_token", "kv_pool_shape",
           "resolve_executor", "resolve_weights_mode", "rope_inv_freq"]

def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes in all layers: ``pdserve.kv_budget.token_bytes`` (``num_layers * 2 *
    num_kv_heads * head_dim * itemsize``, K and V; the supervisor sizes the pools with it, without torch)."""
    from pdserve.kv_budget import token_bytes

    return token_bytes(config.num_layers, config.num_kv_heads, config.head_dim,
                       torch.empty((), dtype=dtype).element_size())


def kv_pool_shape(config: ModelConfig, num_blocks: int, block_tokens: int) -> tuple[int, ...]:
    """Shape of the KV pool tensor: ``(num_layers, 2, num_blocks, block_tokens, num_kv_heads, head_dim)``."""
    return (config.num_layers, 2, num_blocks, block_tokens, config.num_kv_heads, config.head_dim)



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


EXECUTORS = ("auto", "torch", "lowbit", "cuda")


def resolve_executor(executor: str, native: bool) -> str:
    """The path a model runs on: ``"lowbit"`` (native weights; CPU), ``"torch"`` (dense torch, any device) or
    ``"cuda"`` (gpu/exec_cuda.py); ``"auto"`` = ``"lowbit"`` for native weights, else ``"torch"``.

    Raises:
        ValueError: an unknown name, or native weights on another path than ``"lowbit"`` (or dense ones on it).
    """
    if executor not in EXECUTORS:
        raise ValueError(f"executor {executor!r}: must be one of {', '.join(EXECUTORS)}")
    if executor == "auto":
        return "lowbit" if native else "torch"
    if (executor == "lowbit") != native:
        raise ValueError(f"executor {executor!r} with {'native low-bit' if native else 'dense'} weights: the "
                         "lowbit path runs native weights (weights='auto' on CPU) and only them")
    return executor


class LlamaModel(LayerMath):
    """A decoder of any family in gpu/families.py (the name is historical) that reads and writes a caller-owned
    paged KV pool.

    Args:
        config: from :func:`gpu.loader.load_weights`.
        weights: HF-named weights from :func:`gpu.loader.load_weights`: tensors (their dtype becomes the compute
            dtype unless ``native``), or with ``native`` also :class:`gpu.quant.Int4Groups` /
            :class:`gpu.quant.Int5Groups` / :class:`gpu.quant.Int8Groups` / :class:`gpu.quant.Int8HalfGroups` for
            GGUF-quantized linears, kept packed.
        device: where the weights (and every ``kv`` pool passed in) live.
        native: run packed weights with gpu/lowbit_cpu.py's GEMV (``weights="auto"`` in the engine) when a
            prefill has fewer than ``dense_min_tokens`` tokens, their float32 copies otherwise (every prefill by
            default); decode steps of fewer than ``decode_stacked_max_rows`` rows run the GEMV too, every layer in
            one numba call (``lowbit_cpu.decode_layers``) where the layer is Llama's, op by op otherwise; a decode
            step's output projection runs low-bit below
            ``head_dense_min_rows`` rows, a prefill's as its layers do; activations stay float32. False = the
            dense path in the tensors' dtype.
        executor: the execution path (:func:`resolve_executor`), chosen here once: ``"auto"``, ``"torch"``,
            ``"lowbit"`` or ``"cuda"``.
        executor_options: keyword arguments of the ``"cuda"`` path (``attention_backend``, ``linear_backend``,
            ``target_ctas``; gpu/exec_cuda.py).

    Calls keep no per-request state (the pool holds it all). ``prefill``/``decode`` run under
    ``torch.inference_mode()``, so the logits they return are inference tensors: modify them in place only
    inside ``torch.inference_mode()`` (or work on a copy made there).
    """

    def __init__(self, config: ModelConfig, weights: dict[str, Any], device: str | torch.device = "cpu",
                 native: bool = False, executor: str = "auto", executor_options: dict[str, Any] | None = None):
        if native and torch.device(device).type != "cpu":
            raise ValueError("native low-bit weights run on CPU only; use float32 or bfloat16 on other devices")
        dev = torch.device(device)
        dtype, embedding, lm_head, norm, layers, inv_freq = build_layers(config, weights, dev, native)
        self._setup(config, dev, dtype, native, embedding, lm_head, norm, layers, inv_freq, executor,
                    executor_options)

    def _setup(self, config: ModelConfig, device: torch.device, dtype: torch.dtype, native: bool,
               embedding: QuantLinear, lm_head: QuantLinear, norm: torch.Tensor, layers: list[Layer],
               inv_freq: torch.Tensor, executor: str = "auto",
               executor_options: dict[str, Any] | None = None) -> None:
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
        self._init_rope(inv_freq)
        self._scale = config.attn_scale or 1.0 / math.sqrt(config.head_dim)
        self._embed_scale = math.sqrt(config.hidden_size) if config.spec.embed_scale else None
        self._silu = config.spec.activation == "silu"
        # the one-call low-bit decode (lowbit_cpu.decode_layers) computes Llama's layer exactly, nothing else
        self._llama_layers = (config.spec.llama_like and not any(self._windows) and config.attn_scale is None
                              and config.attn_softcap is None and config.final_softcap is None)
        self.executor = self._make_executor(resolve_executor(executor, native), executor_options or {})

    def use_executor(self, executor: str, options: dict[str, Any] | None = None) -> None:
        """Run on another path from now on (``resolve_executor``'s names; ``options``: the cuda path's knobs). The
        actors choose once, after loading (actors/shell.choose_executor). Raises ValueError as the constructor."""
        self.executor = self._make_executor(resolve_executor(executor, self.native), options or {})

    def _make_executor(self, path: str, options: dict[str, Any]) -> Any:
        """The executor object of ``path`` (resolved) over this model."""
        if options and path != "cuda":
            raise ValueError(f"executor options {sorted(options)} are for the cuda path, not {path!r}")
        if path == "lowbit":
            from .exec_lowbit import LowbitExecutor  # noqa: PLC0415  (numba: only a native model's process)
            return LowbitExecutor(self)
        if path == "cuda":
            from .exec_cuda import cuda_executor  # noqa: PLC0415  (gpu.kernels: only the CUDA path imports them)
            return cuda_executor(self, **options)
        return self._torch_executor()

    def _torch_executor(self) -> TorchExecutor:
        """The dense torch executor of this model's attention kind (gpu/mla.py's MLAModel has its own)."""
        return TorchExecutor(self)

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
            getattr(layer, e) for e in Layer.EXTRAS if getattr(layer, e) is not None)] + [self.norm]
        return sum(lin.weight_bytes for lin in linears + [self.lm_head]) + sum(
            t.numel() * t.element_size() for t in norms)


    # -- prepared state (gpu/prepared.py caches it on disk) ------------------------------------------------

    def to_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The built model as ``(meta, tensors)``: JSON-able ``meta`` (config, mode, each linear's kind) and flat
        CPU ``tensors`` (packed weights as they run), so :meth:`from_state` rebuilds it without the model file
        (``gpu.prepared.model_state``)."""
        from .prepared import model_state  # noqa: PLC0415
        return model_state(self)

    @classmethod
    def from_state(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor],
                   device: str | torch.device = "cpu", executor: str = "auto",
                   executor_options: dict[str, Any] | None = None) -> "LlamaModel":
        """Rebuild a model from :meth:`to_state`'s output (tensors used as given, e.g. memory-mapped) on the
        ``executor`` path (``gpu.prepared.model_from_state``).

        Raises:
            KeyError, ValueError, TypeError: ``meta`` or ``tensors`` are incomplete or inconsistent.
        """
        from .prepared import model_from_state  # noqa: PLC0415
        return model_from_state(meta, tensors, device, executor, executor_options)

    @classmethod
    def from_path(cls, path: str | os.PathLike | None = None, device: str | torch.device = "cpu",
                  progress: bool = True, dtype: torch.dtype = torch.float32, weights: str = "",
                  executor: str = "auto", executor_options: dict[str, Any] | None = None) -> "LlamaModel":
        """Load weights with :func:`gpu.loader.load_weights` (None = the default model) and build the model
        (a :class:`gpu.mla.MLAModel` for a family with ``attention == "mla"``) on the ``executor`` path.

        ``weights``: ``"auto"``, ``"float32"`` or ``"bfloat16"`` (see :func:`resolve_weights_mode`); empty =
        dense in ``dtype``.

        Raises:
            ModelLoadError: see :func:`gpu.loader.load_weights`.
            ValueError: an unknown ``weights`` mode or executor.
        """
        mode = resolve_weights_mode(weights, device) if weights else str(dtype).removeprefix("torch.")
        native = mode == "native"
        load_dtype = torch.float32 if native else getattr(torch, mode)
        config, tensors = load_weights(path, dtype=load_dtype, progress=progress, native=native)
        if config.spec.attention == "mla":  # multi-head latent attention (DeepSeek-V2): gpu/mla.py
            from .mla import MLAModel  # noqa: PLC0415
            return MLAModel(config, tensors, device=device, native=native, executor=executor,
                            executor_options=executor_options)
        return cls(config, tensors, device=device, native=native, executor=executor,
                   executor_options=executor_options)

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
                       logits: list[bool] | None = None, gemm_threads: int = 0,
                       hidden: list[bool] | None = None) -> list[torch.Tensor | None]:
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
            hidden: ``[B]`` flags: sequence ``b`` gets its tokens' final hidden states after the final norm (what
                the LM head would read; Hugging Face's ``last_hidden_state``) instead of logits (embeddings,
                actors/model_runner.py; default: none does).
        Returns:
            ``B`` items: float32 ``[T_b, hidden_size]`` where ``hidden[b]``, else float32 ``[T_b, vocab]`` where
            ``all_logits[b]``, else the last token's ``[vocab]``, or None where ``logits[b]`` is False.
        Raises:
            ValueError: mismatched list lengths, no sequences, or any sequence's bad argument (see
                :meth:`prefill`).
        """
        self._gemm_threads = gemm_threads
        try:
            return self.executor.prefill_packed(kv, token_ids, block_tables, start_positions, all_logits, logits,
                                                hidden)
        finally:
            self._gemm_threads = 0


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
        return self.executor.decode(kv, token_ids, positions, block_tables)

    # -- the native path's state, kept on the model (the engine and tests read and set it here) -------------

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

    def _stack_layers(self) -> tuple | None:
        """The native executor's layers stacked for ``lowbit_cpu.decode_layers`` (``LowbitExecutor.stack_layers``);
        None on other paths or where the layers are not Llama's in Q4/Q8h tiles."""
        stack = getattr(self.executor, "stack_layers", None)
        return stack() if stack is not None else None

    @property
    def _stacked(self) -> tuple | None:
        """The stacks :meth:`_stack_layers` built: None before, ``()`` when not applicable (settable: ``()`` forces
        the op-by-op path)."""
        return getattr(self.executor, "stacked", None)

    @_stacked.setter
    def _stacked(self, value: tuple | None) -> None:
        self.executor.stacked = value


def from_path(path: str | os.PathLike | None = None, device: str | torch.device = "cpu",
              progress: bool = True, dtype: torch.dtype = torch.float32) -> LlamaModel:
    """Module-level alias of :meth:`LlamaModel.from_path`."""
    return LlamaModel.from_path(path, device=device, progress=progress, dtype=dtype)
