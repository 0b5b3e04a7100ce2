"""Config: defaults < env < flags, validation names the field, unknown PDSERVE_* suggests the nearest name.
Faults: parsed and validated at start-up; counts, fractions and request-id prefixes select events."""
from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

from pdserve.config import check_env, load_config
from pdserve.errors import ConfigError
from pdserve.faults import FaultPlan, parse_faults


def test_flags_beat_env_beat_defaults_and_sources_are_recorded():
    loaded = load_config({"inflight_timeout_s": "3"}, {"PDSERVE_INFLIGHT_TIMEOUT_S": "2", "PDSERVE_PORT": "9001"})
    assert loaded.config.inflight_timeout_s == 3.0 and loaded.sources["inflight_timeout_s"] == "flag"
    assert loaded.config.port == 9001 and loaded.sources["port"] == "env"
    assert loaded.config.monitor_tick_s == 0.5 and loaded.sources["monitor_tick_s"] == "default"


def test_a_typo_in_an_env_var_is_an_error_that_suggests_the_right_name():
    with pytest.raises(ConfigError, match="did you mean PDSERVE_INFLIGHT_TIMEOUT_S"):
        load_config(None, {"PDSERVE_INFLIGHT_TIMOUT_S": "2"})


@pytest.mark.parametrize("field,value,rule", [("monitor_tick_s", "0", "> 0"), ("inflight_timeout_s", "-1", "> 0"),
                                              ("port", "70000", "0..65535"), ("device", "tpu", "one of")])
def test_out_of_range_values_name_the_field_value_and_rule(field, value, rule):
    with pytest.raises(ConfigError) as info:
        load_config({field: value}, {})
    assert field in str(info.value) and value in str(info.value) and rule in str(info.value)


def test_every_pdserve_variable_the_docs_and_tools_name_is_a_config_field_and_only_the_config_reads_them():
    """Following a doc or a script must never make ``pdserve serve`` exit 2 on an unknown variable (as
    PDSERVE_AUTOTUNE_CACHE did), and no module reads PDSERVE_* around the config (a side channel)."""
    root = Path(__file__).resolve().parents[2]
    files = [root / "README.md", *(root / "docs").rglob("*.md"), *(root / "tools").rglob("*.sh"),
             *(root / "bench").rglob("*.sh")]
    for package in ("actors", "api", "gpu", "ipc", "pdserve", "tools", "bench"):
        files += [p for p in (root / package).rglob("*.py") if p != root / "pdserve" / "config.py"]
    named: set[str] = set()
    for path in files:
        text = path.read_text(errors="replace")
        named |= set(re.findall(r"\bPDSERVE_[A-Z0-9_]+", text))
        assert not re.search(r"environ(\.get)?\s*[\[(]\s*[\"']PDSERVE_", text), f"{path} reads PDSERVE_* itself"
    assert "PDSERVE_AUTOTUNE_CACHE" in named
    check_env({name: "x" for name in named})  # raises ConfigError naming an unknown one
    assert load_config(None, {"PDSERVE_AUTOTUNE_CACHE": "/tmp/t.json"}).config.autotune_cache == "/tmp/t.json"


def test_non_numeric_value_is_a_config_error():
    with pytest.raises(ConfigError, match="not a valid float"):
        load_config(None, {"PDSERVE_MONITOR_TICK_S": "fast"})


def test_config_is_frozen():
    config = load_config(None, {}).config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1
    assert config.port == 8000


@pytest.mark.parametrize("spec,message", [("explode", "unknown fault"), ("stall:seconds=1", "needs"),
                                          ("drop_transfer_done:colour=red", "takes"),
                                          ("crash:actor=gpu7", "actor must be"),
                                          ("stop_holding_lock:actor=prefill0", "decode actors only"),
                                          ("drop_transfer_done:fraction=2", "fraction"),
                                          ("transfer_stuck:actor=api", "actor must be"),
                                          ("router_count_drift:count_delta=1,actor=decode0", "takes"),
                                          ("delay_transfer_done:seconds=soon", "bad number")])
def test_bad_fault_specs_are_rejected_at_start_up(spec, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"PDSERVE_FAULTS": spec})


def test_fault_count_match_and_actor_select_events():
    plan = FaultPlan("drop_transfer_done:count=1,match=s1-;stall:actor=decode0,seconds=1", "decode0")
    assert plan.fires("drop_transfer_done", "other") is None
    assert plan.fires("drop_transfer_done", "s1-a") is not None
    assert plan.fires("drop_transfer_done", "s1-b") is None  # count used up
    assert plan.fires("stall", "x").number("seconds") == 1.0
    assert not FaultPlan("stall:actor=decode0,seconds=1", "prefill0")
    assert not FaultPlan("", "prefill0")
    # an engine actor's fault aimed at one actor of several: only that one applies it
    assert FaultPlan("transfer_stuck:actor=decode1", "decode1").fires("transfer_stuck", "x") is not None
    assert not FaultPlan("transfer_stuck:actor=decode1", "decode0")


def test_drills_add_one_hold_per_stage_aimed_at_its_drill_ids_and_nothing_else():
    from pdserve.faults import DRILL_FAULTS, DRILL_HOLDS

    assert not FaultPlan("", "decode0") and FaultPlan("", "decode0", drills=True)
    assert [f.params["match"] for f in parse_faults(DRILL_FAULTS)] == [f"drill-{s}-" for s in DRILL_HOLDS]
    plan = FaultPlan("", "decode0", drills=True)
    assert plan.fires("hold_decode", "drill-decode-3") is not None
    assert plan.fires("hold_decode", "drill-decode_waiting-3") is None   # one stage's prefix is not another's
    assert plan.fires("hold_decode", "cmpl-1") is None


def test_a_hold_is_judged_once_per_request_and_a_dropped_prefill_request_is_only_the_aimed_one():
    from actors.fault_ports import HeldRequests, drop_prefill_request
    from actors.messages import PrefillRequest
    from pdserve.sampling import Sampling

    held = HeldRequests(FaultPlan("hold_decode:count=1,match=h-", "decode0"))
    assert held.held("hold_decode", (1, 1), "h-1") and held.held("hold_decode", (1, 1), "h-1")   # its count: once
    assert not held.held("hold_decode", (2, 1), "h-2")   # count used up
    held.forget({(2, 1)})
    assert held.judged == {("hold_decode", (2, 1)): False}
    plan = FaultPlan("drop_prefill_request:match=d-", "prefill0")
    assert drop_prefill_request(plan, PrefillRequest(0, 1, "d-1", [1], Sampling()))
    assert not drop_prefill_request(plan, PrefillRequest(0, 1, "e-1", [1], Sampling()))


def test_a_client_request_id_with_the_drill_or_probe_prefix_is_not_taken():
    from api.protocol import check_request_id

    assert check_request_id("drill-transfer-1", "cmpl-9") == "cmpl-9"
    assert check_request_id("drilled-1", "cmpl-9") == "drilled-1"
    # the router's probes' timeouts never count toward ejection: a client's would escape it
    assert check_request_id("eject-probe-3", "cmpl-9") == "cmpl-9"


def test_fault_fraction_is_reproducible_with_a_seed():
    runs = [[f.fires() for f in parse_faults("decode_reject:fraction=0.3,seed=5") for _ in range(50)]
            for _ in range(2)]
    assert runs[0] == runs[1] and 0 < sum(runs[0]) < 50


def test_the_mooncake_transport_is_refused_at_start_up_where_it_cannot_run(monkeypatch):
    with pytest.raises(ConfigError, match="colocated mode has no KV handoff"):
        load_config({"kv_transport": "mooncake", "colocated": True}, {})
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)   # as where the optional extra is not installed
    with pytest.raises(ConfigError, match=r"pip install \.\[mooncake\].*libibverbs1") as info:
        load_config({"kv_transport": "mooncake"}, {})
    assert info.value.param == "kv_transport"
    assert load_config({"kv_transport": "cpu-shm"}, {}).config.kv_transport == "cpu-shm"


def test_the_device_path_settings_are_checked_against_the_device():
    assert load_config({"kv_transport": "torch-ipc"}, {}).config.kv_transport == "torch-ipc"
    assert load_config({}, {}).config.attention_backend == "torch"
    assert load_config({"device": "cuda"}, {}).config.kv_transport == "cuda-ipc"   # the GPU default
    for flags, param, words in [({"kv_transport": "cuda-ipc"}, "kv_transport", "needs device=cuda"),
                                ({"device": "cuda", "kv_transport": "torch-ipc"}, "kv_transport", "use cuda-ipc"),
                                ({"attention_backend": "numba"}, "attention_backend", "needs device=cuda"),
                                ({"attention_backend": "mma"}, "attention_backend", "needs device=cuda")]:
        with pytest.raises(ConfigError, match=words) as info:
            load_config(flags, {})
        assert info.value.param == param
    with pytest.raises(ConfigError, match="attention_backend"):
        load_config({}, {"PDSERVE_ATTENTION_BACKEND": "triton"})


def test_the_executor_hook_keeps_a_cpu_model_and_puts_a_cuda_one_on_the_cuda_executor():
    from actors.shell import choose_executor
    from gpu.model import LlamaModel

    model = LlamaModel.from_path(None, progress=False, weights="float32")   # the embedded model, dense, on the CPU
    assert choose_executor(model, "cpu", "torch") is model and model.executor.name == "torch"
    with pytest.raises(ConfigError, match="numba kernels run on a GPU") as info:
        choose_executor(model, "cpu", "numba")
    assert info.value.param == "attention_backend"
    with pytest.raises((ValueError, RuntimeError), match="CUDA device|simulator"):   # it asked for the cuda path
        choose_executor(model, "cuda", "torch")
