"""What the prefill and decode shells (actors/prefill.py, actors/decode.py) share: start-up of the model, pool and
grammars, and publishing a core's counts to the actor table.

| name              | what                                                                         |
|-------------------|------------------------------------------------------------------------------|
| `load_model`      | torch threads, the prepared model, this actor's pool warmed up and reset       |
| `choose_executor` | THE hook where a loaded model's execution path is picked (device, attention)   |
| `pool_tensor`     | the tensor the model computes on: the shm pool's data, or a device tensor      |
| `publish_tensor_pool` | a tensor transport's export of the prefill pool (once, after the reset)   |
| `configure_model` | the engine settings that change how a loaded model computes                    |
| `prefills_low_bit`| whether a configured model prefills on its low-bit kernels                     |
| `decode_threads`  | how many threads a decode step's low-bit GEMVs use (auto: the idle cores)      |
| `load_sampling`   | the sampler and the grammar compiler (warmed up by the actor once READY)       |
| `GaugePublisher`  | own gauges, requests done, free KV blocks and prefix-cache counters, as deltas |
"""
from __future__ import annotations

import os

# a native model's dense_min_tokens under prefill_low_bit: no prefill is that long
PREFILL_LOW_BIT_MIN_TOKENS = 1 << 62
# auto decode_threads: smaller steps stay on one thread (a second thread sped one row up in process, and slowed the
# engine's tokens and warm TTFT beside the API and prefill processes: `python -m bench.anchors --variant
# "threads1=--decode-threads 1"` compares them)
DECODE_THREADS_MIN_ROWS = 4


def load_model(actor, decode: bool):
    """``(model, pool, kv)`` for ``actor`` (an actors.base.Actor): the prepared model on its executor
    (``choose_executor``), its attached KV pool (the KV table) and the tensor the model computes on
    (``pool_tensor``), after a warm-up pass (``decode=False``: an actor that never decodes skips the decode step,
    unless the model runs a prompt's last token as one, ``prompt_last_by_decode``; a prefill actor's also plans its
    most prefill threads; a decode actor's skips the prefill unless it is colocated) between two resets (a
    restarted actor starts from an empty pool; its old requests were failed)."""
    import torch

    from actors.model_runner import warm_up
    from gpu.prepared import prepared_model
    from ipc.kv_pool import KVPool

    config = actor.config
    torch.set_num_threads(config.torch_threads)
    model = configure_model(prepared_model(actor.layout.model_path or None, config.weights, config.device,
                                           config.model_cache_dir or None), config)
    model = choose_executor(model, config.device, config.attention_backend)
    pool = KVPool.attach(actor.layout.segment(actor.topology.segment("kv", actor.index)))
    kv = pool_tensor(config, pool)
    pool.reset()   # a predecessor's blocks (a full prefix cache, say) must not leave warm-up without one
    warm_up(model, pool, kv, decode=decode or getattr(model, "prompt_last_by_decode", False),
            threads=decode_threads(config, actor.topology.num_decode) if decode else 1,
            prefill_threads=1 if decode else prefill_threads(config, actor.topology.num_prefill),
            prefill=not decode or config.colocated)
    pool.reset()
    return model, pool, kv


def choose_executor(model, device: str, attention_backend: str):
    """The one place an actor picks how ``model`` (loaded for ``device``: ``cpu`` or ``cuda``, the actor's own GPU)
    executes. On a CPU the path it was loaded for (native low-bit or dense torch); ``attention_backend`` must be
    ``torch`` there. On ``cuda`` the CUDA executor (gpu/exec_cuda.py) with that decode attention: ``torch`` (SDPA
    over the gathered pages), ``numba`` (the paged kernel) or ``mma`` (its tensor-core tiles). Returns the model.
    Raises ConfigError for a kernel backend on a CPU."""
    from pdserve.errors import ConfigError

    if device != "cuda":
        if attention_backend != "torch":
            raise ConfigError(f"config field attention_backend={attention_backend!r} on device={device!r}: the "
                              f"numba kernels run on a GPU; use torch", param="attention_backend")
        return model
    model.use_executor("cuda", {"attention_backend": attention_backend})
    return model


def pool_tensor(config, pool):
    """The tensor the model reads and writes KV in, ``[num_layers, 2, num_blocks, block_tokens, num_kv_heads,
    head_dim]``: the shm pool's own data (``pool.tensor()``) for cpu-shm and mooncake; for the tensor transports a
    zeroed tensor on this actor's device (``cuda``: the one GPU CUDA_VISIBLE_DEVICES leaves it; torch-ipc: ``cpu``),
    registered for the pool's transport (gpu/cuda_ipc.allocate_device_pool)."""
    from ipc.kv_transport import TENSOR_POOL_TRANSPORTS

    if config.kv_transport not in TENSOR_POOL_TRANSPORTS:
        return pool.tensor()
    from gpu.cuda_ipc import allocate_device_pool

    return allocate_device_pool(pool, "cuda" if config.device == "cuda" else "cpu")


def publish_tensor_pool(kind: str, pool, kv):
    """The source side of a tensor transport (cuda-ipc, torch-ipc): export ``kv``, the data of ``pool``, once
    (gpu/cuda_ipc.PoolExport; call after the pool's last reset, so the export carries its epoch). Returns the
    export (``record_written`` after each prefill forward, ``close`` at stop), or None for the other transports."""
    from ipc.kv_transport import TENSOR_POOL_TRANSPORTS

    if kind not in TENSOR_POOL_TRANSPORTS:
        return None
    from gpu.cuda_ipc import publish_export

    return publish_export(kind, pool, kv)


def configure_model(model, config):
    """``model`` (a gpu.model.LlamaModel) set up for ``config`` (pdserve.config.EngineConfig): a native model
    prefills on its low-bit kernels with ``prefill_low_bit`` (``dense_min_tokens`` past any prompt), on its float32
    copies without (gpu.model.DENSE_MIN_TOKENS); other models are left as they are (no low-bit kernels). Returns
    ``model``."""
    from gpu.model import DENSE_MIN_TOKENS

    if getattr(model, "native", False):
        model.dense_min_tokens = PREFILL_LOW_BIT_MIN_TOKENS if config.prefill_low_bit else DENSE_MIN_TOKENS
    return model


def decode_threads(config, decode_actors: int, busy_prefill: int = 0, cpus: int | None = None,
                   rows: int | None = None) -> int:
    """Threads for a decode step of ``rows`` rows (None: the most any step gets) on the low-bit kernels
    (``lowbit_cpu.set_threads``): ``config.decode_threads`` when set (> 0); else (auto) 1 for a step of fewer
    than DECODE_THREADS_MIN_ROWS rows, otherwise ``cpus`` (default: the CPUs this process may run on) less
    ``torch_threads`` for each of ``busy_prefill`` (prefill actors with requests queued or prefilling), shared
    among this node's ``decode_actors``; at least 1. Other engines on the same host are not seen."""
    if config.decode_threads > 0:
        return config.decode_threads
    if rows is not None and rows < DECODE_THREADS_MIN_ROWS:
        return 1
    if cpus is None:
        cpus = len(os.sched_getaffinity(0))
    return max(1, (cpus - busy_prefill * config.torch_threads) // max(1, decode_actors))


def prefill_threads(config, prefill_actors: int, busy_decode: int = 0, cpus: int | None = None) -> int:
    """Torch threads for a native model's prefill GEMMs (``actors.model_runner.prefill_forward``; the model runs
    its float32 copies on them where ``gpu.model.gemm_plan`` finds the bits of one thread):
    ``config.prefill_threads`` when set (> 0); else (auto) ``torch_threads`` while any of this node's decode
    actors has work or is about to (``busy_decode``: those whose own gauges say so, plus one while the prefill
    actor's inflight queue holds requests it handed off), otherwise ``cpus`` (default: the CPUs this
    process may run on) shared among this node's ``prefill_actors``; never below ``torch_threads``."""
    if config.prefill_threads > 0:
        return config.prefill_threads
    if busy_decode:
        return config.torch_threads
    if cpus is None:
        cpus = len(os.sched_getaffinity(0))
    return max(config.torch_threads, cpus // max(1, prefill_actors))


def prefills_low_bit(model) -> bool:
    """Whether ``model`` prefills on its low-bit kernels (``configure_model`` with ``prefill_low_bit``)."""
    return getattr(model, "native", False) and model.dense_min_tokens == PREFILL_LOW_BIT_MIN_TOKENS


def load_sampling(actor):
    """``(Sampler, GrammarCompiler)``; the compiler's tokenizer view (~0.9 s of CPU) is built on first use, or
    by ``grammars.warm_up()``, which the actors call once READY (``on_ready``) so it does not compete with the
    engine's start-up."""
    from gpu.grammar import GrammarCompiler
    from gpu.model_files import model_cache_dir
    from gpu.sampling import Sampler

    grammars = GrammarCompiler(actor.layout.model_path, cache_dir=model_cache_dir(actor.config.model_cache_dir))
    return Sampler(), grammars


class GaugePublisher:
    """Writes one actor's counts to its actor-table row (``actors``: an ipc.actor_table.ActorTable): own gauges
    every call, the rest only when changed. ``allocator``: the pool's (actors/prefix_cache.CachingAllocator;
    evictable cached blocks count as free)."""

    def __init__(self, actors, index: int, pool, allocator):
        self.actors, self.index, self.pool, self.allocator = actors, index, pool, allocator
        self.free = -1
        self.done = 0
        self.cache = (0, 0, 0)   # query tokens, hit tokens, evicted blocks published so far
        self.hand_back = (0, 0)   # blocks cached from hand-backs, hand-backs dropped, published so far

    def publish(self, gauges: dict[str, int], done: int, hand_backs_dropped: int = 0) -> None:
        """``gauges``: the core's ``own_gauges()``; ``done``: its requests done so far, ``hand_backs_dropped``:
        KVHandBacks it dropped so far (running totals)."""
        self.actors.set_own_gauges(self.index, **gauges)
        if done != self.done:
            self.actors.count_requests_done(self.index, done - self.done)
            self.done = done
        if self.allocator.num_free != self.free:
            self.free = self.allocator.num_free
            self.actors.set_kv_blocks(self.index, total=self.pool.num_blocks, free=self.free)
        if self.allocator.enabled:
            now = (self.allocator.query_tokens, self.allocator.hit_tokens, self.allocator.evicted_blocks)
            if now != self.cache:
                self.actors.count_prefix_cache(self.index, *(a - b for a, b in zip(now, self.cache)))
                self.cache = now
            self.actors.set_prefix_cache(self.index, self.allocator.cached_blocks,
                                         self.allocator.cached_blocks_in_use)
        now = (self.allocator.adopted_blocks, hand_backs_dropped)
        if now != self.hand_back:
            self.actors.count_hand_backs(self.index, *(a - b for a, b in zip(now, self.hand_back)))
            self.hand_back = now
