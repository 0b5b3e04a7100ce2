"""The KV reservation formula, written once: what a sequence reserves in a decode pool; and the pools' size.

| name               | what                                                                   |
|--------------------|------------------------------------------------------------------------|
| `blocks_for`       | blocks for prompt + max_tokens tokens (api/admission.py, api/protocol.py, actors/decode_core.py) |
| `token_bytes`      | bytes one token's K and V take in every layer (gpu.model.kv_bytes_per_token's formula too) |
| `auto_pool_tokens` | `kv_pool_tokens=0` (the default): tokens per pool from the model's context and the machine's memory |
| `memory_available` | MemAvailable, /dev/shm's free bytes and the memory cgroup's headroom, read once at start-up |
| `shm_free`         | /dev/shm's free bytes (where the pools' data lives), or None where it is absent        |
| `cgroup_headroom`  | bytes this process's memory cgroup (v1 or v2) and its ancestors may still charge, or None |
"""
from __future__ import annotations

import os

CONTEXTS_PER_POOL = 2       # auto: a pool holds this many full contexts (two long conversations stay cached)
MEMORY_SHARE = 0.25         # auto: all of a node's pools together take at most this share of available memory
GPU_POOL_TOKENS = 8192      # auto on device cuda: at most this many tokens a pool (GPU memory is not measured yet)
ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}   # a KV element's bytes by dtype name


def blocks_for(prompt_tokens: int, max_tokens: int, block_tokens: int) -> int:
    """KV blocks one sequence of ``prompt_tokens`` prompt tokens reserves to generate up to ``max_tokens``:
    ``ceil((prompt_tokens + max_tokens) / block_tokens)``. Raises ValueError for ``block_tokens <= 0``."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    return -(-(prompt_tokens + max_tokens) // block_tokens)


def token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes of KV one token takes: ``num_layers * 2 (K and V) * num_kv_heads * head_dim * elem_bytes``."""
    return num_layers * 2 * num_kv_heads * head_dim * elem_bytes


def auto_pool_tokens(context_tokens: int, bytes_per_token: int, pools: int, available_bytes: int,
                     block_tokens: int, gpu: bool = False) -> tuple[int, str]:
    """Tokens per KV pool for ``kv_pool_tokens=0``: :data:`CONTEXTS_PER_POOL` times the model's context, capped so
    that the ``pools`` pools of this node take at most :data:`MEMORY_SHARE` of ``available_bytes`` (the pools are
    shared memory, allocated in full at start-up), in whole blocks of ``block_tokens``, at least one block.
    ``gpu``: the pools are tensors on the actors' GPUs, whose memory this does not measure: at most
    :data:`GPU_POOL_TOKENS` (the former fixed default). Returns (tokens, a line saying which bound chose them).
    Raises ValueError for a non-positive argument."""
    if min(context_tokens, bytes_per_token, pools, block_tokens) <= 0 or available_bytes < 0:
        raise ValueError(f"auto_pool_tokens({context_tokens}, {bytes_per_token}, {pools}, {available_bytes}, "
                         f"{block_tokens}): every argument must be > 0")
    want = CONTEXTS_PER_POOL * context_tokens
    if gpu:   # the pools are device tensors: the host's memory does not bound them
        tokens = max(block_tokens, min(want, GPU_POOL_TOKENS) // block_tokens * block_tokens)
        return tokens, (f"{CONTEXTS_PER_POOL} x the model's {context_tokens}-token context" if want <= GPU_POOL_TOKENS
                        else f"at most {GPU_POOL_TOKENS} tokens a pool on a GPU (its memory is not measured yet; "
                             f"the model's context: {context_tokens} tokens)")
    cap = int(available_bytes * MEMORY_SHARE) // (pools * bytes_per_token)
    tokens = max(block_tokens, min(want, cap) // block_tokens * block_tokens)
    why = (f"{CONTEXTS_PER_POOL} x the model's {context_tokens}-token context" if want <= cap else
           f"capped at {MEMORY_SHARE:.0%} of {available_bytes / 2**30:.1f} GiB available over {pools} pools "
           f"(the model's context: {context_tokens} tokens)")
    return tokens, why


def memory_available() -> int:
    """Bytes the pools may take: the smallest of /proc/meminfo's MemAvailable, /dev/shm's free space (where the
    pools live) and the memory cgroup's headroom (:func:`cgroup_headroom`: in a container with a memory limit
    MemAvailable is the host's, and the pools' shared memory is charged to the container); MemAvailable alone
    where /dev/shm is absent, free pages times page size without /proc."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    headroom = cgroup_headroom()
    if headroom is not None:
        avail = min(avail, headroom)
    free = shm_free()
    return avail if free is None else min(avail, free)


def shm_free() -> int | None:
    """Bytes free in /dev/shm (the shm pools' home: a segment past it fails its start-up posix_fallocate), or None
    where /dev/shm is absent."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


_NO_LIMIT = 1 << 60   # cgroup v1 writes "no limit" as a page-rounded 2**63-1


def cgroup_headroom(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup may still charge before it hits a limit: over its cgroup and every
    ancestor visible under ``root`` (a container sees its own cgroup at ``root``), the smallest limit minus usage,
    usage less the inactive file cache (reclaimable; the working set docker and the kubelet report). v2:
    ``memory.max``, ``memory.current``, ``memory.stat``'s ``inactive_file``; v1 (the ``memory`` controller's
    line): ``memory.limit_in_bytes``, ``memory.usage_in_bytes``, ``total_inactive_file``. None where no limit is
    set or nothing is readable (no cgroup fs, another OS). Never below 0."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    found: list[int] = []
    for parts in lines:
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "memory" in controllers.split(","):
            base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                          "total_inactive_file")
        elif controllers == "":
            base, files = root, ("memory.max", "memory.current", "inactive_file")
        else:
            continue
        rel = path.strip("/")
        while True:
            left = _headroom_at(os.path.join(base, rel), *files)
            if left is not None:
                found.append(left)
            if not rel:
                break
            rel = os.path.dirname(rel)
    return max(0, min(found)) if found else None


def _headroom_at(directory: str, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    """Limit minus working set of the cgroup at ``directory``, or None (no limit, or not readable)."""
    try:
        with open(os.path.join(directory, limit_file)) as f:
            raw = f.read().strip()
        if raw == "max" or int(raw) >= _NO_LIMIT:
            return None
        with open(os.path.join(directory, usage_file)) as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            inactive = next((int(v) for k, v in (line.split() for line in f if line.strip()) if k == inactive_key), 0)
    except (OSError, ValueError):
        pass
    return int(raw) - max(0, usage - inactive)
