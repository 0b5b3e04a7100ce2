"""Which device each engine actor runs on, and the environment its child process starts with.

``--device cuda --prefill-devices 0,1 --decode-devices 2,3`` means one actor per listed GPU ordinal: prefill0 on
GPU 0, prefill1 on GPU 1, decode0 on GPU 2, decode1 on GPU 3. Each child gets ``CUDA_VISIBLE_DEVICES`` set to its
ordinal before it imports anything (``actors.base.run_actor``), so inside it the device is ``cuda`` (= its
``cuda:0``). Two actors of one role on one device are refused (they would fight over one GPU's memory for no
gain); a prefill and a decode actor may share one. With ``--device cpu`` the lists must be empty and the counts
come from ``--prefill-actors`` / ``--decode-actors``. Plain code: no CUDA, no processes.
"""
from __future__ import annotations

from pdserve.config import EngineConfig
from pdserve.errors import ConfigError


def parse_devices(text: str, field: str) -> tuple[int, ...]:
    """``"0,1"`` -> ``(0, 1)``; ``""`` -> ``()``. Raises ConfigError (param ``field``) for a value that is not a
    non-negative integer, or an ordinal listed twice (two actors of one role on one device)."""
    if not text.strip():
        return ()
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ConfigError(f"config field {field}={text!r}: {part!r} is not a GPU ordinal (0, 1, ...)",
                              param=field)
        ordinal = int(part)
        if ordinal in out:
            raise ConfigError(f"config field {field}={text!r}: GPU {ordinal} is listed twice; one actor of a role "
                              f"per device", param=field)
        out.append(ordinal)
    return tuple(out)


def role_counts(config: EngineConfig) -> tuple[int, int]:
    """``(prefill actors, decode actors)`` (colocated or ``role`` decode: no prefill actor; ``role`` prefill: no
    decode actor). Raises ConfigError for device lists with ``device=cpu``, a list whose length contradicts an
    explicit actor count, or prefill devices in colocated mode."""
    counts = []
    for role, count in (("prefill", config.prefill_actors), ("decode", config.decode_actors)):
        field = f"{role}_devices"
        devices = parse_devices(getattr(config, field), field)
        if devices and config.device != "cuda":
            raise ConfigError(f"config field {field}: GPU ordinals need device=cuda (device={config.device!r}); "
                              f"use {role}_actors for CPU actors", param=field)
        if devices and count not in (1, len(devices)):
            raise ConfigError(f"config field {field}={getattr(config, field)!r} lists {len(devices)} devices but "
                              f"{role}_actors={count}; give one of them", param=field)
        counts.append(len(devices) or count)
    if config.colocated:
        if parse_devices(config.prefill_devices, "prefill_devices"):
            raise ConfigError("config field prefill_devices: colocated mode has no prefill actor",
                              param="prefill_devices")
        counts[0] = 0
    if config.role == "prefill":   # a prefill node: its KVReady goes to a decode node through the API
        counts[1] = 0
    elif config.role == "decode":   # a decode node: KVReady arrives from a prefill node through the API
        counts[0] = 0
    return counts[0], counts[1]


def actor_devices(config: EngineConfig) -> tuple[list[str], list[str]]:
    """The device label of each prefill and each decode actor (``"cpu"``, or ``"cuda:<ordinal>"``; an unlisted
    role on cuda runs on GPU 0)."""
    num_prefill, num_decode = role_counts(config)
    out = []
    for role, count in (("prefill", num_prefill), ("decode", num_decode)):
        devices = parse_devices(getattr(config, f"{role}_devices"), f"{role}_devices")
        if config.device != "cuda":
            out.append(["cpu"] * count)
        else:
            out.append([f"cuda:{d}" for d in devices] if devices else ["cuda:0"] * count)
    return out[0], out[1]


def child_environment(device: str) -> dict[str, str]:
    """Environment variables a child on ``device`` starts with: ``{"CUDA_VISIBLE_DEVICES": "<ordinal>"}`` for
    ``cuda:<ordinal>``, nothing for cpu or for the API and monitor (``""``)."""
    if device.startswith("cuda:"):
        return {"CUDA_VISIBLE_DEVICES": device.split(":", 1)[1]}
    return {}
