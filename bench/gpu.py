#!/usr/bin/env python3
"""GPU benchmark of issue 6, all on one GPU in one run, printed as markdown tables (docs/performance-gpu.md).

Sections (``--sections``, default all):

* ``ipc``: CUDA IPC KV handoff (``gpu/cuda_ipc.py``: a producer process exports a Llama-3.2-1B-shaped bf16
  pool, this process pulls scattered blocks) for prompts of 512 / 4096 / 16384 tokens: copy GB/s with the
  numba one-launch kernel and with torch index ops, against a plain device-to-device copy of the same bytes,
  and the handoff latency (``start_copy`` until ``poll`` says DONE, wall clock).
* ``attention``: decode attention of one layer, bf16, blocks of 16 tokens scattered over the pool: numba
  paged kernel (``target_ctas`` autotuned, and without a split) vs the torch path of ``LlamaModel.decode``
  (gather + SDPA) vs SDPA over contiguous K/V, for the SmolLM2-135M (9/3 heads, d 64) and Llama-3-8B
  (32/8 heads, d 128) shapes, batch 1 / 16 / 64, context 512 / 4096.
* ``matmul``: the numba tiled matmul (split-K autotuned) vs ``torch.matmul`` (cuBLAS) on the Llama-3.2-1B
  QKV projection (K 2048 -> N 3072), fp32 (TF32 off) and bf16, M = 1 / 64 / 4096 rows.
* ``engine``: random-weight Llama-3.2-1B shape, bf16: ``LlamaModel`` prefill (TTFT) and decode tokens/s at
  batch 1 and 16, vs Hugging Face ``generate`` on the same weights, vs the HBM bound (weights + KV bytes per
  step / copy bandwidth measured in this run). Model level: the actors' GPU wiring is not in yet.

Timings are CUDA-event medians after warm-up, unless a column says wall clock. Run from the repository root:
``python bench/gpu.py [--quick] [--out docs/performance-gpu.md] [--json out.json]``. Without a CUDA
device it prints why and exits with status 2. ``--smoke`` runs every section but ``ipc`` at toy sizes on CPU
under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``): a test of this script, not a measurement.
"""
from __future__ import annotations

import os
import sys

# Run as a script, Python puts bench/ first on sys.path, where bench/gpu.py and bench/ipc.py would shadow the
# packages of those names: put the repository root there instead.
_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _TOOLS]
if os.path.dirname(_TOOLS) not in sys.path:
    sys.path.insert(0, os.path.dirname(_TOOLS))

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

SECTIONS = ("ipc", "attention", "matmul", "engine")
ATTN_SHAPES = {"SmolLM2-135M": (9, 3, 64), "Llama-3-8B": (32, 8, 128)}  # heads, kv heads, head_dim


@dataclass
class Plan:
    """Sizes of one run: the real one on a GPU, or the toy one of ``--smoke`` (CPU, CUDA simulator)."""

    device: str = "cuda"
    attn_shapes: dict = field(default_factory=lambda: dict(ATTN_SHAPES))
    attn_batches: tuple = (1, 16, 64)
    attn_contexts: tuple = (512, 4096)
    block_tokens: int = 16
    mm_k_n: tuple = (2048, 3072)  # Llama-3.2-1B fused QKV projection
    mm_rows: tuple = (1, 64, 4096)
    engine_small: bool = False
    prompt_len: int = 512
    engine_batches: tuple = (1, 16)
    waves: tuple = (0, 1, 2, 4, 8)  # target_ctas candidates, in multiples of the SM count


SMOKE = Plan(device="cpu", attn_shapes={"toy GQA": (4, 2, 16)}, attn_batches=(1, 2), attn_contexts=(10,),
             block_tokens=4, mm_k_n=(16, 24), mm_rows=(1, 5), engine_small=True, prompt_len=8,
             engine_batches=(1, 2), waves=(0, 1))


# ---------------------------------------------------------------------------------------------- helpers

def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cuda_ms(fn, *, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` between CUDA events on the current stream (wall clock on CPU)."""
    if not torch.cuda.is_available():
        return wall_ms(fn, warmup=warmup, iters=iters)
    from gpu.kernels.autotune import cuda_event_timer

    return cuda_event_timer(warmup, iters)(fn) * 1e3


def wall_ms(fn, *, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def table(title: str, columns: list[str], rows: list[dict], note: str = "") -> str:
    out = [f"### {title}", ""]
    if note:
        out += [note, ""]
    out.append("| " + " | ".join(columns) + " |")
    out.append("|" + "|".join("---" for _ in columns) + "|")
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(out) + "\n"


def _fmt(v) -> str:
    if isinstance(v, float):
        if v == 0 or math.isnan(v):
            return f"{v:g}"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def copy_bandwidth_gbs(nbytes: int = 1 << 30, *, iters: int = 10, device: str = "cuda") -> float:
    """HBM traffic GB/s of a device-to-device copy (read + write counted: 2 * bytes / time)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = cuda_ms(lambda: b.copy_(a), warmup=3, iters=iters)
    a = b = None  # free before the next allocation
    return 2 * nbytes / (ms / 1e3) / 1e9


def header(args, argv) -> str:
    if args.plan.device == "cpu":
        props = type("CPU", (), {"name": "CPU smoke run (CUDA simulator; not a measurement)",
                                 "multi_processor_count": 0, "total_memory": 0})
    else:
        props = torch.cuda.get_device_properties(0)
    try:
        import numba  # noqa: PLC0415

        numba_v = numba.__version__
        try:
            import numba_cuda  # noqa: PLC0415

            numba_v += f", numba-cuda {numba_cuda.__version__}"
        except ImportError:
            pass
    except ImportError:
        numba_v = "not installed"
    return "\n".join([
        "## GPU benchmark (bench/gpu.py)", "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- GPU: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB",
        f"- software: torch {torch.__version__} (CUDA {torch.version.cuda}), numba {numba_v}, "
        f"Python {platform.python_version()}",
        f"- command: `python bench/gpu.py {' '.join(argv)}`"
        + (" (quick mode: fewer iterations and decode steps)" if args.quick else ""),
        "",
    ])


# ---------------------------------------------------------------------------------------------- ipc

LLAMA_1B_KV = dict(num_layers=16, block_tokens=16, num_kv_heads=8, head_dim=64)


def _ipc_producer(pool_name: str, ready, done) -> None:
    """The prefill side: a device pool filled with noise, exported once through CUDA IPC."""
    from gpu.cuda_ipc import CudaIpcExport, allocate_device_pool  # noqa: PLC0415
    from ipc.kv_pool import KVPool  # noqa: PLC0415

    torch.cuda.init()
    pool = KVPool.attach(pool_name)
    kv = allocate_device_pool(pool, "cuda:0")
    kv.normal_()
    export = CudaIpcExport.publish(pool, kv)
    torch.cuda.synchronize()
    ready.set()
    done.wait(900)
    export.close()
    pool.close()


def _ipc_row(transports, s_ids: list[int], d_ids: list[int], n_tok: int, nbytes: int, args) -> dict:
    """One prompt size of bench_ipc: each transport's copy bandwidth (device time) and latency (wall clock from
    start_copy to the DONE poll), next to a contiguous device-to-device copy of the same bytes."""
    from ipc.kv_transport import TransferStatus  # noqa: PLC0415

    row = {"prompt tokens": n_tok, "MiB": nbytes / 2**20}
    for x in transports:
        def once(x=x):
            h = x.start_copy(s_ids, d_ids, num_tokens=n_tok)
            while x.poll(h) == TransferStatus.IN_PROGRESS:
                pass
            if x.poll(h) != TransferStatus.DONE:
                raise RuntimeError(f"transfer failed: {x.error(h)}")
            x.release(h)

        for _ in range(args.warmup):
            once()
        dev_ms, lat_ms = [], []
        for _ in range(args.iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record(x._stream)
            h = x.start_copy(s_ids, d_ids, num_tokens=n_tok)
            b.record(x._stream)
            while x.poll(h) == TransferStatus.IN_PROGRESS:
                pass
            lat_ms.append((time.perf_counter() - t0) * 1e3)
            b.synchronize()
            dev_ms.append(a.elapsed_time(b))
            x.release(h)
        row[f"IPC {x.copy_backend} GB/s"] = nbytes / (statistics.median(dev_ms) / 1e3) / 1e9
        row[f"latency {x.copy_backend} ms"] = statistics.median(lat_ms)
    a_buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b_buf = torch.empty_like(a_buf)
    d2d_ms = cuda_ms(lambda: b_buf.copy_(a_buf), warmup=args.warmup, iters=args.iters)
    row["D2D GB/s"] = nbytes / (d2d_ms / 1e3) / 1e9
    row["numba / D2D"] = row["IPC numba GB/s"] / row["D2D GB/s"]
    return row


def bench_ipc(args) -> tuple[str, list[dict]]:
    import multiprocessing as mp  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    from ipc import naming  # noqa: PLC0415
    from gpu.cuda_ipc import CudaIpcTransport, allocate_device_pool  # noqa: PLC0415
    from ipc.kv_pool import KVPool  # noqa: PLC0415

    prompts = [512, 4096, 16384]
    bt = LLAMA_1B_KV["block_tokens"]
    token_bytes = 16 * 2 * 8 * 64 * 2  # layers * (K, V) * kv heads * head_dim * bf16
    num_blocks = prompts[-1] // bt + 64
    pool_bytes = num_blocks * bt * token_bytes
    free = shutil.disk_usage("/dev/shm").free
    while 2 * pool_bytes + (64 << 20) > free and len(prompts) > 1:  # the KV tables' shm data (unused on GPU)
        prompts.pop()
        num_blocks = prompts[-1] // bt + 64
        pool_bytes = num_blocks * bt * token_bytes
    note = (f"Llama-3.2-1B KV shape (16 layers, 8 kv heads, d 64, bf16, blocks of {bt} tokens: "
            f"{token_bytes // 1024} KiB per token). GB/s = bytes moved / device time of the copy (ids upload "
            f"and event wait included); D2D = `dst.copy_(src)` of the same bytes, contiguous. Latency: wall "
            f"clock from start_copy to the poll that sees DONE.")
    if len(prompts) < 3:
        note += f" /dev/shm has {free >> 20} MiB free: prompts limited to {prompts}."
    eid = naming.new_engine_id()
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    src = KVPool.create(naming.segment_name(eid, "kvp"), num_blocks=num_blocks, dtype=torch.bfloat16,
                        **LLAMA_1B_KV)
    dst = KVPool.create(naming.segment_name(eid, "kvd"), num_blocks=num_blocks, dtype=torch.bfloat16,
                        **LLAMA_1B_KV)
    proc = ctx.Process(target=_ipc_producer, args=(src.name, ready, done))
    proc.start()
    rows: list[dict] = []
    transports = []
    try:
        if not ready.wait(120):
            raise RuntimeError(f"the IPC producer did not publish (exit code {proc.exitcode})")
        kv_dst = allocate_device_pool(dst, "cuda:0")
        for backend in ("numba", "torch"):
            x = CudaIpcTransport(dst, device_kv=kv_dst, copy_backend=backend)
            x.open_peer(src.name)
            transports.append(x)
        rng = np.random.default_rng(0)
        for n_tok in prompts:
            nb = -(-n_tok // bt)
            s_ids = rng.choice(num_blocks, nb, replace=False).tolist()
            d_ids = rng.choice(num_blocks, nb, replace=False).tolist()
            rows.append(_ipc_row(transports, s_ids, d_ids, n_tok, nb * src.block_bytes, args))
        # correctness spot check of the last copy (numba backend wrote first, torch second: same data)
        peer = transports[0]._src
        assert torch.equal(kv_dst[:, :, d_ids[:4]], peer[:, :, s_ids[:4]]), "IPC copy differs from its source"
    finally:
        for x in transports:
            x.close()
        done.set()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        for pool in (src, dst):
            pool.close()
            pool.unlink()
        naming.unlink_all(eid)
    cols = ["prompt tokens", "MiB", "IPC numba GB/s", "IPC torch GB/s", "D2D GB/s", "numba / D2D",
            "latency numba ms", "latency torch ms"]
    return table("CUDA IPC KV handoff", cols, rows, note), rows


# ---------------------------------------------------------------------------------------------- attention

def bench_attention(args, tuner) -> tuple[str, list[dict]]:
    from gpu.kernels import (dense_attention_decode_torch, mma_attention_decode,  # noqa: PLC0415
                             paged_attention_decode, paged_attention_decode_torch)
    from gpu.kernels._runtime import multiprocessor_count  # noqa: PLC0415

    plan = args.plan
    dev = plan.device
    sm = multiprocessor_count()
    candidates = [w * sm for w in plan.waves]
    bt = plan.block_tokens
    rows = []
    for name, (H, Hkv, D) in plan.attn_shapes.items():
        for B in plan.attn_batches:
            for S in plan.attn_contexts:
                g = torch.Generator(device=dev).manual_seed(0)
                nbs = -(-S // bt)
                NB = B * nbs + 1
                kv = torch.randn(2, NB, bt, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
                perm = torch.randperm(NB, device=dev, generator=g)[:B * nbs]
                tables = perm.view(B, nbs).to(torch.int32)
                lens = torch.full((B,), S, dtype=torch.int32, device=dev)
                q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16, generator=g)
                k_dense = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16, generator=g)
                v_dense = torch.randn_like(k_dense)

                def numba_run(t, q=q, kv=kv, tables=tables, lens=lens, S=S):
                    return paged_attention_decode(q, kv, tables, lens, target_ctas=t, max_seq_len=S)

                best = tuner.best("paged_attention_decode", f"{name}_b{B}_s{S}_bf16_bt{bt}",
                                  lambda t, f=numba_run: f(t), candidates)
                it = dict(warmup=args.warmup, iters=args.iters)
                t_best = cuda_ms(lambda: numba_run(best), **it)
                t_nosplit = t_best if best == 0 else cuda_ms(lambda: numba_run(0), **it)
                t_torch = cuda_ms(lambda: paged_attention_decode_torch(q, kv, tables, lens, max_seq_len=S),
                                  **it)
                t_dense = cuda_ms(lambda: dense_attention_decode_torch(q, k_dense, v_dense), **it)
                want = paged_attention_decode_torch(q, kv, tables, lens).float()
                err = (numba_run(best).float() - want).abs().max().item()
                mma_ok = D % 16 == 0 and H // Hkv <= 16  # the tensor-core kernel's shapes
                t_mma = cuda_ms(lambda: mma_attention_decode(q, kv, tables, lens), **it) if mma_ok else None
                err_mma = (mma_attention_decode(q, kv, tables, lens) - want).abs().max().item() if mma_ok else None
                kv_bytes = B * S * Hkv * D * 2 * 2
                rows.append({"model shape": name, "batch": B, "context": S, "numba ms": t_best,
                             "target_ctas": best, "numba no-split ms": t_nosplit, "torch paged ms": t_torch,
                             "dense SDPA ms": t_dense, "numba speed vs torch paged": t_torch / t_best,
                             "numba GB/s": kv_bytes / (t_best / 1e3) / 1e9, "max abs err": err,
                             "numba vs dense SDPA": t_dense / t_best, "mma ms": t_mma,
                             "mma vs dense SDPA": t_dense / t_mma if t_mma else None, "mma max abs err": err_mma})
                kv = k_dense = v_dense = None  # noqa: F841 - free before the next shape
    note = ("One layer, bf16, one new query token per sequence, every sequence at the full context; blocks "
            f"of {bt} tokens scattered over the pool. torch paged = `LlamaModel.decode`'s path (index_select "
            "gather + SDPA with GQA); dense = SDPA over contiguous K/V (no paging). numba GB/s = K+V bytes / "
            "time. Times include host launch overhead where it exceeds the GPU time (small shapes). target "
            "0 = one CTA per (sequence, kv head). max abs err: numba vs torch paged. mma = the tensor-core kernel "
            "(gpu/kernels/mma_attention.py: QK^T and PV as mma.sync tiles, one warp per (sequence, kv head), no "
            "context split). X vs dense SDPA = SDPA time / X time (> 1: X is faster).")
    cols = ["model shape", "batch", "context", "numba ms", "target_ctas", "numba no-split ms",
            "torch paged ms", "dense SDPA ms", "numba speed vs torch paged", "numba GB/s", "max abs err",
            "numba vs dense SDPA", "mma ms", "mma vs dense SDPA", "mma max abs err"]
    return table("Paged-attention decode", cols, rows, note), rows


# ---------------------------------------------------------------------------------------------- matmul

def bench_matmul(args, tuner) -> tuple[str, list[dict]]:
    from gpu.kernels import mma_linear, tiled_linear  # noqa: PLC0415
    from gpu.kernels._runtime import multiprocessor_count  # noqa: PLC0415

    plan = args.plan
    dev = plan.device
    sm = multiprocessor_count()
    K, N = plan.mm_k_n
    rows = []
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 against fp32, not TF32 tensor cores
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for M in plan.mm_rows:
                g = torch.Generator(device=dev).manual_seed(1)
                x = torch.randn(M, K, device=dev, dtype=dtype, generator=g)
                w = torch.randn(N, K, device=dev, dtype=dtype, generator=g)
                best = tuner.best("tiled_linear", f"m{M}_k{K}_n{N}_{str(dtype)[6:]}",
                                  lambda t, x=x, w=w: tiled_linear(x, w, target_ctas=t),
                                  [w_ * sm for w_ in plan.waves if w_ <= 4])
                it = dict(warmup=args.warmup, iters=args.iters)
                t_numba = cuda_ms(lambda: tiled_linear(x, w, target_ctas=best), **it)
                t_torch = cuda_ms(lambda: torch.matmul(x, w.T), **it)
                ref = torch.matmul(x.float(), w.float().T)
                got = tiled_linear(x, w, target_ctas=best).float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                flop = 2 * M * N * K
                t_mma = mma_err = mma_best = None
                if dtype == torch.bfloat16:  # tensor-core tiles take 16-bit inputs
                    mma_best = tuner.best("mma_linear", f"m{M}_k{K}_n{N}_bf16",
                                          lambda t, x=x, w=w: mma_linear(x, w, target_ctas=t),
                                          [w_ * sm for w_ in plan.waves if w_ <= 4])
                    t_mma = cuda_ms(lambda: mma_linear(x, w, target_ctas=mma_best), **it)
                    got = mma_linear(x, w, target_ctas=mma_best, out_dtype=torch.float32)
                    mma_err = ((got - ref).abs().max() / ref.abs().max()).item()
                rows.append({"dtype": str(dtype)[6:], "M": M, "numba TFLOP/s": flop / (t_numba / 1e3) / 1e12,
                             "target_ctas": best, "torch.matmul TFLOP/s": flop / (t_torch / 1e3) / 1e12,
                             "numba / torch": t_torch / t_numba, "numba ms": t_numba, "torch ms": t_torch,
                             "rel err": err, "mma TFLOP/s": flop / (t_mma / 1e3) / 1e12 if t_mma else None,
                             "mma target_ctas": mma_best, "mma / torch": t_torch / t_mma if t_mma else None,
                             "mma rel err": mma_err})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    note = (f"y = x @ W.T, K = {K}, N = {N} (Llama-3.2-1B fused QKV at full size). numba = the shared-memory "
            "tiled kernel on CUDA cores (gpu/kernels/matmul.py); mma = the tensor-core kernel (gpu/kernels/mma.py: "
            "mma.sync m16n8k16 linked from CUDA C++, bf16 rows only); fp32 accumulation in both. cuBLAS uses "
            "tensor cores for bf16. TF32 is off for the fp32 rows. rel err = max |kernel - fp32 reference| / "
            "max |reference|. X / torch > 1: X is faster.")
    cols = ["dtype", "M", "numba TFLOP/s", "target_ctas", "torch.matmul TFLOP/s", "numba / torch", "numba ms",
            "torch ms", "rel err", "mma TFLOP/s", "mma target_ctas", "mma / torch", "mma rel err"]
    return table("Tiled matmul vs cuBLAS", cols, rows, note), rows


# ---------------------------------------------------------------------------------------------- engine

def llama_1b_config(small: bool = False):
    from gpu.loader import ModelConfig  # noqa: PLC0415

    if small:  # --smoke
        return ModelConfig(name="toy", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                           intermediate_size=64, vocab_size=100, rope_theta=10000.0, rms_norm_eps=1e-5,
                           max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
                           eos_token_ids=(2,))
    return ModelConfig(name="llama-3.2-1b-shape (random weights)", num_layers=16, hidden_size=2048,
                       num_heads=32, num_kv_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                       rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                       tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001,))


def random_weights(c, dtype, device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(2)

    def rnd(*shape):
        return (torch.randn(*shape, device=device, generator=g) * 0.02).to(dtype)

    w = {"model.embed_tokens.weight": rnd(c.vocab_size, c.hidden_size),
         "model.norm.weight": torch.ones(c.hidden_size, device=device, dtype=dtype)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(c.hidden_size, device=device, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(c.hidden_size, device=device, dtype=dtype)
        w[p + "self_attn.q_proj.weight"] = rnd(c.num_heads * c.head_dim, c.hidden_size)
        w[p + "self_attn.k_proj.weight"] = rnd(c.num_kv_heads * c.head_dim, c.hidden_size)
        w[p + "self_attn.v_proj.weight"] = rnd(c.num_kv_heads * c.head_dim, c.hidden_size)
        w[p + "self_attn.o_proj.weight"] = rnd(c.hidden_size, c.num_heads * c.head_dim)
        w[p + "mlp.gate_proj.weight"] = rnd(c.intermediate_size, c.hidden_size)
        w[p + "mlp.up_proj.weight"] = rnd(c.intermediate_size, c.hidden_size)
        w[p + "mlp.down_proj.weight"] = rnd(c.hidden_size, c.intermediate_size)
    return w


def _hf_generate_rows(c, weights, dtype, dev, plan, steps: int, g, weight_bytes: int, kv_tok: int,
                      hbm_gbs: float) -> list[dict]:
    """bench_engine's Hugging Face ``generate`` rows on the same weights (one row saying why, if it fails)."""
    rows: list[dict] = []
    prompt_len = plan.prompt_len
    try:
        import transformers  # noqa: PLC0415

        cfg = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                       intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                                       num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                                       head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings,
                                       rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=True,
                                       bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids))
        with torch.device(dev):
            hf = transformers.LlamaForCausalLM(cfg).to(dtype)
        missing, unexpected = hf.load_state_dict(weights, strict=False)
        if [m for m in missing if "lm_head" not in m and "rotary" not in m] or unexpected:
            raise RuntimeError(f"HF weights mismatch: missing {missing[:4]}, unexpected {unexpected[:4]}")
        hf.eval()
        for B in plan.engine_batches:
            ids = torch.tensor([torch.randint(0, c.vocab_size, (prompt_len,), generator=g).tolist()
                                for _ in range(B)], device=dev)
            kw = dict(do_sample=False, pad_token_id=0)

            def gen(n, ids=ids, kw=kw):
                with torch.inference_mode():
                    return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

            gen(2)
            t1 = wall_ms(lambda: gen(1), warmup=0, iters=3)
            tn = wall_ms(lambda: gen(steps + 1), warmup=0, iters=1)
            tps = B * steps / ((tn - t1) / 1e3)
            step_bytes = weight_bytes + B * (prompt_len + steps / 2) * kv_tok
            bound_tps = B * hbm_gbs * 1e9 / step_bytes
            rows.append({"impl": f"HF transformers {transformers.__version__} generate", "batch": B,
                         "TTFT ms": t1, "decode tok/s": tps, "ms / step": (tn - t1) / steps,
                         "HBM bound tok/s": bound_tps, "% of bound": 100 * tps / bound_tps})
        hf = None  # noqa: F841
    except Exception as exc:  # noqa: BLE001 - the rest of the table is still worth printing
        rows.append({"impl": f"HF generate: {type(exc).__name__}: {str(exc)[:120]}"})
    return rows


def bench_engine(args, hbm_gbs: float) -> tuple[str, list[dict]]:
    from gpu.model import LlamaModel, kv_bytes_per_token  # noqa: PLC0415

    plan = args.plan
    dev = plan.device
    dtype = torch.bfloat16
    c = llama_1b_config(plan.engine_small)
    weights = random_weights(c, dtype, dev)
    model = LlamaModel(c, weights, device=dev)
    prompt_len, bt = plan.prompt_len, plan.block_tokens
    steps = 3 if plan.engine_small else (32 if args.quick else 128)
    blocks_per_seq = -(-(prompt_len + steps + 1) // bt)
    rows = []
    weight_bytes = sum(t.numel() * t.element_size() for k, t in weights.items()
                       if k != "model.embed_tokens.weight") + weights["model.embed_tokens.weight"].numel() * 2
    # per step every weight matrix is read once (the tied embedding as the LM head), plus the KV read
    kv_tok = kv_bytes_per_token(c, dtype)
    for backend in ("torch", "numba", "mma"):   # the CUDA executor's decode attention (--attention-backend)
        model.use_executor("cuda", {"attention_backend": backend})
        rows += _engine_rows(model, c, plan, args, steps, blocks_per_seq, weight_bytes, kv_tok, hbm_gbs, backend)
    g = torch.Generator().manual_seed(3)
    rows += _hf_generate_rows(c, weights, dtype, dev, plan, steps, g, weight_bytes, kv_tok, hbm_gbs)
    note = (f"Random-weight Llama-3.2-1B shape ({weight_bytes / 1e9:.2f} GB of bf16 weights read per step, "
            f"tied embedding as LM head), prompt {prompt_len} tokens, {steps} greedy decode steps, host-side "
            f"argmax every step, on the CUDA executor (gpu/exec_cuda.py) with each decode attention. HBM bound = "
            f"{hbm_gbs:,.0f} GB/s (this run's device copy, read + write) / (weight bytes + batch x mean "
            "context x KV bytes per token). "
            "TTFT: prefill + first-token argmax, wall clock, per sequence.")
    cols = ["impl", "batch", "TTFT ms", "decode tok/s", "ms / step", "HBM bound tok/s",
            "% of bound"]
    return table("Decode throughput, Llama-3.2-1B shape", cols, rows, note), rows


def _engine_rows(model, c, plan, args, steps: int, blocks_per_seq: int, weight_bytes: int, kv_tok: int,
                 hbm_gbs: float, backend: str) -> list[dict]:
    from gpu.model import kv_pool_shape  # noqa: PLC0415

    dev, bt, prompt_len, dtype = plan.device, plan.block_tokens, plan.prompt_len, model.dtype
    rows = []
    g = torch.Generator().manual_seed(3)
    for B in plan.engine_batches:
        pool = torch.zeros(kv_pool_shape(c, B * blocks_per_seq, bt), dtype=dtype, device=dev)
        tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(B)]
        prompts = [torch.randint(0, c.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(B)]
        model.prefill(pool, prompts[0], tables[0])  # warm-up (kernels, allocator)
        sync()
        t0 = time.perf_counter()
        first = [int(model.prefill(pool, prompts[b], tables[b]).argmax()) for b in range(B)]
        ttft_ms = (time.perf_counter() - t0) * 1e3 / B
        tokens, pos = first, [prompt_len] * B
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = model.decode(pool, tokens, pos, tables)
            tokens = logits.argmax(-1).tolist()  # the engine samples on the host every step: same sync
            pos = [p + 1 for p in pos]
        dt = time.perf_counter() - t0
        tps = B * steps / dt
        ctx_mean = prompt_len + steps / 2
        step_bytes = weight_bytes + B * ctx_mean * kv_tok
        bound_tps = B * hbm_gbs * 1e9 / step_bytes
        rows.append({"impl": f"pdserve cuda executor ({backend} attention)", "batch": B, "TTFT ms": ttft_ms,
                     "decode tok/s": tps, "ms / step": dt * 1e3 / steps, "HBM bound tok/s": bound_tps,
                     "% of bound": 100 * tps / bound_tps})
        del pool
    return rows


# ---------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations and decode steps (device checks)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--out", help="also write the markdown here")
    ap.add_argument("--json", help="also write every row as JSON here")
    ap.add_argument("--smoke", action="store_true",
                    help="toy sizes on CPU under NUMBA_ENABLE_CUDASIM=1 (tests this script; measures "
                         "nothing)")
    ap.add_argument("--tune-cache", help="target_ctas autotune cache (default: a fresh one next to --json, "
                                         "else the user cache)")
    args = ap.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    args.plan = Plan()
    if args.smoke:
        from gpu.kernels import simulator  # noqa: PLC0415

        if not simulator():
            ap.error("--smoke runs the kernels in the CUDA simulator: set NUMBA_ENABLE_CUDASIM=1")
        args.plan = SMOKE
        sections = [s for s in sections if s != "ipc"]  # CUDA IPC has no simulator
    elif not torch.cuda.is_available():
        print(f"bench/gpu.py: no CUDA device (torch {torch.__version__} reports "
              f"torch.cuda.is_available() == False): nothing was measured. Run it on a machine with an "
              f"NVIDIA GPU, e.g. through tools/gpu_device_check.sh (docs/gpu.md).", file=sys.stderr)
        return 2
    args.warmup, args.iters = (0, 1) if args.smoke else (2, 5) if args.quick else (3, 20)
    from gpu.kernels import TargetCtasTuner  # noqa: PLC0415

    tune_cache = args.tune_cache or (str(Path(args.json).with_suffix(".autotune.json")) if args.json
                                     else None)

    def tune_timer(fn) -> float:
        return cuda_ms(fn, warmup=min(1, args.warmup), iters=max(1, args.iters // 2)) / 1e3

    tuner = TargetCtasTuner("" if args.smoke else tune_cache, device_name="cpu-sim" if args.smoke else None,
                            timer=tune_timer)
    parts = [header(args, argv)]
    results: dict[str, object] = {"argv": argv}
    hbm = copy_bandwidth_gbs(1 << 20 if args.smoke else 1 << 30, device=args.plan.device)
    parts.append(f"Device-to-device copy: {hbm:,.0f} GB/s of HBM traffic (read + write, 1 GiB).\n")
    results["hbm_copy_gbs"] = hbm
    print(parts[0] + parts[1], flush=True)
    for section in sections:
        t0 = time.perf_counter()
        try:
            if section == "ipc":
                text, rows = bench_ipc(args)
            elif section == "attention":
                text, rows = bench_attention(args, tuner)
            elif section == "matmul":
                text, rows = bench_matmul(args, tuner)
            else:
                text, rows = bench_engine(args, hbm)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next section
            text = (f"### {section}\n\nFAILED: {type(exc).__name__}: {exc}\n\n"
                    f"```\n{traceback.format_exc()[-3000:]}```\n")
            rows = [{"error": f"{type(exc).__name__}: {exc}"}]
        text += f"\n({section}: {time.perf_counter() - t0:.0f} s)\n"
        print(text, flush=True)
        parts.append(text)
        results[section] = rows
        torch.cuda.empty_cache()
    results["autotune"] = {k: {str(c): t for c, t in v.items()} for k, v in tuner.measured.items()}
    if args.out:
        Path(args.out).write_text("\n".join(parts))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
