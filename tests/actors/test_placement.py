"""N x M topology and GPU placement (actors/topology.py, actors/placement.py): plain code, no GPU needed."""
from __future__ import annotations

import pytest

from actors.topology import topology
from actors.placement import actor_devices, child_environment, parse_devices
from actors.supervisor import actor_device_map, check_device
from pdserve.config import load_config
from pdserve.errors import ConfigError


def config(**flags):
    return load_config(flags, env={}).config


def test_the_default_is_one_by_one_with_the_historic_indices():
    topo = topology(config())
    assert topo.names == ("prefill0", "decode0", "api", "monitor")
    assert (topo.prefill, topo.decode, topo.api, topo.monitor) == ((0,), (1,), 2, 3)


def test_two_by_three_names_roles_and_segments():
    topo = topology(config(prefill_actors=2, decode_actors=3))
    assert topo.names == ("prefill0", "prefill1", "decode0", "decode1", "decode2", "api", "monitor")
    assert [topo.role(i) for i in range(7)] == ["prefill"] * 2 + ["decode"] * 3 + ["api", "monitor"]
    assert topo.segment("kv", 3) == "kv_decode1" and topo.segment("q", 1) == "q_prefill1"
    assert topo.class_path(4) == "actors.decode:DecodeActor"


def test_colocated_has_decode_actors_only():
    topo = topology(config(colocated=True, decode_actors=2))
    assert topo.names == ("decode0", "decode1", "api", "monitor") and topo.prefill == ()


def test_gpu_lists_set_one_actor_per_device_and_each_child_sees_only_its_own():
    cfg = config(device="cuda", prefill_devices="0,1", decode_devices="2,3")
    topo = topology(cfg)
    assert (len(topo.prefill), len(topo.decode)) == (2, 2)
    assert actor_devices(cfg) == (["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"])
    devices = actor_device_map(cfg, topo)
    assert {topo.names[i]: child_environment(d) for i, d in devices.items()} == {
        "prefill0": {"CUDA_VISIBLE_DEVICES": "0"}, "prefill1": {"CUDA_VISIBLE_DEVICES": "1"},
        "decode0": {"CUDA_VISIBLE_DEVICES": "2"}, "decode1": {"CUDA_VISIBLE_DEVICES": "3"}}
    assert child_environment("") == {} and child_environment("cpu") == {}


def test_cpu_actors_get_no_cuda_environment():
    cfg = config(prefill_actors=2, decode_actors=1)
    assert actor_devices(cfg) == (["cpu", "cpu"], ["cpu"])


@pytest.mark.parametrize("flags, param", [
    ({"device": "cuda", "decode_devices": "2,2"}, "decode_devices"),          # two decode actors on one GPU
    ({"device": "cuda", "prefill_devices": "0,x"}, "prefill_devices"),
    ({"device": "cuda", "prefill_devices": "-1"}, "prefill_devices"),
    ({"prefill_devices": "0,1"}, "prefill_devices"),                           # GPU ordinals with device=cpu
    ({"device": "cuda", "decode_devices": "0,1", "decode_actors": 3}, "decode_devices"),
    ({"device": "cuda", "colocated": True, "prefill_devices": "0"}, "prefill_devices"),
])
def test_refused_placements_name_the_field(flags, param):
    with pytest.raises(ConfigError) as info:
        topology(config(**flags))
    assert info.value.param == param


def test_a_prefill_and_a_decode_actor_may_share_a_gpu():
    assert parse_devices("0", "x") == (0,)
    assert actor_devices(config(device="cuda", prefill_devices="0", decode_devices="0")) == (["cuda:0"], ["cuda:0"])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message given without a GPU")
def test_cuda_on_a_host_without_a_gpu_is_refused_at_start_up_naming_the_missing_device():
    with pytest.raises(ConfigError, match=r"device='cuda': torch.cuda.is_available\(\) is False") as info:
        check_device(config(device="cuda", prefill_devices="0,1", decode_devices="2,3").device)
    assert info.value.param == "device"
    check_device("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_cuda_is_accepted_where_torch_sees_a_gpu():
    check_device("cuda")
