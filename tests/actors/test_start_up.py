"""Start-up planning (``plan_layout`` in actors/supervisor.py): what the engine refuses before it spawns
anything, and the resolved values it hands the actors under names of their own."""
from __future__ import annotations

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
