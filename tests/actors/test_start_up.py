"""Start-up planning (``plan_layout`` in actors/supervisor.py): what the engine refuses before it spawns
anything, and the resolved values it hands the actors under names of their own."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.monitor import HeartbeatMonitor
from actors.supervisor import plan_layout
from pdserve.config import load_config
from pdserve.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


NO_GPU = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message given without a GPU")


@NO_GPU
def test_device_cuda_on_a_host_without_a_gpu_is_refused_naming_the_missing_device():
    with pytest.raises(ConfigError) as info:
        plan_layout(load_config({"device": "cuda"}, {}), "e1")
    message = str(info.value)
    assert "device='cuda'" in message and info.value.param == "device"
    assert all(part in message for part in ("torch.cuda.is_available() is False", "GPU", "device=cpu"))


@NO_GPU
@pytest.mark.timeout(120)
def test_serve_with_device_cuda_on_a_host_without_a_gpu_exits_at_start_up_with_that_message():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    result = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--device", "cuda", "--port", "0"],
                            cwd=ROOT, env=env, capture_output=True, timeout=100)
    err = result.stderr.decode()
    assert result.returncode == 1, err
    assert "device='cuda': torch.cuda.is_available() is False on this host" in err and "Traceback" not in err, err


def test_resolved_values_have_names_of_their_own_and_the_config_keeps_what_was_given():
    loaded = load_config({"port": "0", "idle_wait_s": "0.2", "queue_put_timeout_s": "3"}, {})
    layout = plan_layout(loaded, "e1")
    assert (layout.config.max_model_len, layout.config.port) == (0, 0)   # as given: 0 = fit / any free port
    pool_tokens = layout.kv_blocks_per_pool * layout.config.kv_block_tokens
    assert layout.max_context_tokens == min(layout.shape.context_length, pool_tokens) > 0
    assert 0 < layout.http_port <= 65535
    actor = HeartbeatMonitor(layout)
    assert (actor.idle_wait_s, actor.queue_put_timeout_s) == (0.2, 3.0)


def test_the_kv_cache_is_float16_for_the_native_path_on_cpu_and_float32_where_answers_must_equal_hf():
    """``kv_cache_dtype=auto``: float16 with weights auto on CPU (the native low-bit path), float32 with float32
    weights (the HF-exact path); given explicitly, as given; float16 on cuda is refused by name."""
    from pdserve.config import kv_cache_dtype

    assert plan_layout(load_config({"port": "0"}, {}), "e1").kv_dtype == "float16"
    assert plan_layout(load_config({"port": "0", "weights": "float32"}, {}), "e1").kv_dtype == "float32"
    assert plan_layout(load_config({"port": "0", "kv_cache_dtype": "float32"}, {}), "e1").kv_dtype == "float32"
    assert kv_cache_dtype(load_config({"weights": "bfloat16", "kv_cache_dtype": "float16"}, {}).config) == "float16"
    with pytest.raises(ConfigError) as info:
        load_config({"device": "cuda", "kv_cache_dtype": "float16"}, {})
    assert info.value.param == "kv_cache_dtype" and "float32" in str(info.value)


def test_the_default_pool_holds_two_contexts_unless_memory_is_short_and_says_which(monkeypatch):
    """``kv_pool_tokens=0`` (the default): twice the model's context per pool; on a machine whose available
    memory cannot take that in a quarter, the quarter over the node's pools, in whole blocks; the layout's note
    names the bound. A given size is kept as given."""
    from actors import supervisor
    from pdserve import kv_budget

    layout = plan_layout(load_config({"port": "0"}, {}), "e1")
    assert layout.kv_blocks_per_pool * 16 == 2 * layout.shape.context_length == 16384
    assert "2 x the model's 8192-token context" in layout.kv_pool_note
    # SmolLM2 in float16: 30 layers * 2 * 3 heads * 64 * 2 bytes = 23,040 bytes a token; 4 GiB available over 2
    # pools: a quarter is 1 GiB, 512 MiB a pool, 23,301 tokens -> 23,296 (whole blocks): two contexts still fit
    monkeypatch.setattr(supervisor, "memory_available", lambda: 4 << 30)
    assert plan_layout(load_config({"port": "0"}, {}), "e1").kv_blocks_per_pool * 16 == 16384
    monkeypatch.setattr(supervisor, "memory_available", lambda: 1 << 30)   # 128 MiB a pool: 5,825 -> 5,824 tokens
    small = plan_layout(load_config({"port": "0"}, {}), "e1")
    assert small.kv_blocks_per_pool * 16 == 5824 and small.max_context_tokens == 5824
    assert "capped at 25% of 1.0 GiB available over 2 pools" in small.kv_pool_note
    level, line = supervisor.kv_cache_line(small)   # a start-up WARNING: the engine serves shorter contexts
    assert level == logging.WARNING and "5824 tokens per actor pool" in line and "limited to 5824 tokens" in line
    # docker's default /dev/shm (64 MiB): 16 MiB over 2 pools, 364 -> 352 tokens
    monkeypatch.setattr(supervisor, "memory_available", lambda: 64 << 20)
    level, line = supervisor.kv_cache_line(plan_layout(load_config({"port": "0"}, {}), "e1"))
    assert level == logging.WARNING and "limited to 352 tokens" in line and "--shm-size" in line
    given = plan_layout(load_config({"port": "0", "kv_pool_tokens": "1024"}, {}), "e1")
    assert supervisor.kv_cache_line(given)[0] == logging.INFO   # a size given by hand: as asked
    assert supervisor.kv_cache_line(layout) == (logging.INFO, "KV cache: 16384 tokens per actor pool (kv_pool_tokens=0 "
                                                "(auto): 2 x the model's 8192-token context), float16 (kv_cache_dtype="
                                                "auto): 22.5 KiB a token, 360 MiB a pool")
    assert given.kv_blocks_per_pool == 64 and given.kv_pool_note == "kv_pool_tokens=1024"
    assert kv_budget.auto_pool_tokens(100, 10, 1, 0, 16)[0] == 16   # no memory at all: still one block
    with pytest.raises(ValueError):
        kv_budget.auto_pool_tokens(0, 10, 1, 1 << 30, 16)


@pytest.mark.timeout(120)
def test_a_given_pool_size_past_dev_shm_is_a_start_up_error_naming_kv_pool_tokens():
    """``--kv-pool-tokens`` larger than /dev/shm can hold: refused while planning, by name and with the bytes
    needed and free, not a traceback from the first segment's posix_fallocate part-way through start-up."""
    from pdserve.kv_budget import shm_free

    free = shm_free()
    if free is None:
        pytest.skip("no /dev/shm")
    tokens = (free // 23040 // 16 + 1) * 16   # SmolLM2 float16: 23,040 bytes a token; one pool alone overflows
    with pytest.raises(ConfigError) as info:
        plan_layout(load_config({"port": "0", "kv_pool_tokens": str(tokens)}, {}), "e1")
    assert info.value.param == "kv_pool_tokens" and "/dev/shm has" in str(info.value)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    result = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--port", "0", "--kv-pool-tokens",
                             str(tokens)], cwd=ROOT, env=env, capture_output=True, timeout=100)
    err = result.stderr.decode()
    assert result.returncode == 1 and "Traceback" not in err, err
    assert f"config field kv_pool_tokens={tokens}: the node's 2 KV pools (float16) need" in err, err


def test_a_memory_cgroups_limit_caps_the_memory_the_default_pool_counts_on(tmp_path):
    """In a container MemAvailable is the host's, while the pools' shared memory is charged to the container's
    memory cgroup: the headroom under its limit (less the reclaimable inactive file cache) bounds what the
    default pool counts on, for cgroup v2 and v1 alike, over the cgroup and its ancestors (the smallest wins);
    no limit anywhere (v1 writes it as ~2**63) counts as no bound."""
    from pdserve.kv_budget import cgroup_headroom

    def tree(lines: str, files: dict[str, str]) -> tuple[str, str]:
        for rel, text in files.items():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_text(text)
        (tmp_path / "cgroup").write_text(lines)
        return str(tmp_path / "cgroup"), str(tmp_path / "fs")

    v2 = tree("0::/pod/ctr\n", {"fs/pod/memory.max": str(8 << 30), "fs/pod/memory.current": str(1 << 30),
                                 "fs/pod/ctr/memory.max": str(2 << 30), "fs/pod/ctr/memory.current": str(1 << 30),
                                 "fs/pod/ctr/memory.stat": f"anon 1\ninactive_file {256 << 20}\n",
                                 "fs/memory.max": "max", "fs/memory.current": str(60 << 30)})
    assert cgroup_headroom(*v2) == (2 << 30) - (1 << 30) + (256 << 20)   # the container's, not the pod's 7 GiB
    (tmp_path / "fs/pod/memory.current").write_text(str(int(7.5 * 2**30)))
    assert cgroup_headroom(*v2) == 512 << 20                               # the pod's, now the smaller
    v1 = tree("5:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n",
              {"fs/memory/memory.limit_in_bytes": str(3 << 30), "fs/memory/memory.usage_in_bytes": str(4 << 30),
               "fs/memory/memory.stat": f"cache 9\ntotal_inactive_file {2 << 30}\n"})
    assert cgroup_headroom(*v1) == 1 << 30   # docker without a cgroup namespace: its own cgroup at the root
    (tmp_path / "fs/memory/memory.limit_in_bytes").write_text("9223372036854771712")
    assert cgroup_headroom(*v1) is None
    assert cgroup_headroom(str(tmp_path / "absent"), str(tmp_path / "fs")) is None


def _own_memory_cgroup() -> Path | None:
    """A writable cgroup v1 memory hierarchy dir of this process (root in a container), else None."""
    try:
        line = next(line for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if "memory" in line.split(":")[1].split(","))
    except (OSError, StopIteration, IndexError):
        return None
    here = Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].strip("/")
    return here if here.is_dir() and os.access(here, os.W_OK) else None


@pytest.mark.timeout(120)
def test_the_default_pool_fits_under_a_real_memory_cgroup_limit():
    """A start-up inside a real memory cgroup limited to 1 GiB (a container with ``--memory 1g`` on a big host):
    the default pools take at most a quarter of the headroom under that limit, not of the host's MemAvailable
    (the pools' shared memory is charged to the cgroup: over its limit the engine is OOM-killed at start-up)."""
    parent = _own_memory_cgroup()
    if parent is None:
        pytest.skip("needs a writable cgroup v1 memory hierarchy (root in a container)")
    group = parent / f"pdserve-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(1 << 30))
        script = ("from actors.supervisor import plan_layout; from pdserve.config import load_config; "
                  "from pdserve.kv_budget import memory_available; "
                  "lay = plan_layout(load_config({'port': '0'}, {}), 'e1'); "
                  "print(memory_available(), lay.kv_blocks_per_pool * 16, lay.kv_pool_note)")
        procs = str(group / "cgroup.procs")

        def join_group() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                             timeout=100, preexec_fn=join_group)
        assert out.returncode == 0, out.stderr
        available, tokens, note = out.stdout.split(maxsplit=2)
        assert int(available) <= 1 << 30
        # 2 pools of 23,040 bytes a token in a quarter of at most 1 GiB: at most 5,825 tokens a pool
        assert 0 < int(tokens) <= 5825 and "capped at 25%" in note, out.stdout
    finally:
        group.rmdir()


@pytest.mark.timeout(120)
def test_a_warm_start_plans_names_the_prepared_model_and_creates_every_segment_without_importing_torch():
    """The supervisor's part of a warm start (the prepared model in the cache, as any earlier start left it)
    imports no torch: its ~2 s import would delay every actor's spawn. Run in a fresh interpreter."""
    script = """
import sys
from actors.supervisor import Supervisor, plan_layout
from actors.topology import topology
from pdserve.config import load_config
loaded = load_config({"kv_pool_tokens": "1024"}, {})
sup = Supervisor(loaded)
sup.layout = plan_layout(loaded, sup.engine_id)
sup.topology = topology(sup.layout.config)
try:
    sup._prepare_model()
    sup._create_segments()
    print("torch" in sys.modules, len(sup._owned))
finally:
    sup._unlink_segments()
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    # the prepared model first, in another process (a cold cache builds it with torch, as ensure_prepared does)
    subprocess.run([sys.executable, "-c", "from gpu.prepared import ensure_prepared; ensure_prepared(None, 'auto')"],
                   cwd=ROOT, env=env, check=True, timeout=100)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, timeout=100)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    imported, segments = result.stdout.decode().split()
    assert imported == "False" and int(segments) > 5, result.stdout.decode()


def test_the_default_pool_on_a_gpu_stays_at_the_former_fixed_size_whatever_the_hosts_memory():
    """On device cuda the pools are tensors on the GPU, whose memory the default does not measure: at most
    ``GPU_POOL_TOKENS`` (8,192) tokens a pool, two contexts where they are shorter; the host's memory plays no part."""
    from pdserve import kv_budget

    tokens, why = kv_budget.auto_pool_tokens(131072, 256 << 10, 2, 1 << 40, 16, gpu=True)   # Llama-3.1-8B in float32
    assert tokens == kv_budget.GPU_POOL_TOKENS == 8192 and "on a GPU" in why
    assert kv_budget.auto_pool_tokens(2048, 256 << 10, 2, 0, 16, gpu=True)[0] == 4096
    assert kv_budget.auto_pool_tokens(131072, 256 << 10, 2, 1 << 40, 16)[0] == 262144   # on CPU: two contexts
