"""A small autotune of the ``target_ctas`` knob, run once per (GPU, kernel, shape) and cached on disk.

``target_ctas`` is how many CTAs a kernel spreads over (FlashDecoding split for attention, split-K for the
matmul, CTAs per block row for the KV copy). The best value depends on the GPU (SM count, L2, clocks) and the
shape, so it is measured, not guessed: time each candidate with CUDA events (median of a few runs after a
warm-up), keep the fastest, and store it in a JSON file keyed by ``"<GPU name>|<kernel>|<shape key>"`` so the
next start-up reads it instead of measuring again. The default candidate list is multiples of the SM count
(a wave is one CTA per SM), plus 0 = "no split".

The cache file is the one the caller passes (the engine: config field ``autotune_cache``, so also
``--autotune-cache`` / ``PDSERVE_AUTOTUNE_CACHE``), else ``~/.cache/pdserve/autotune.json``; it is replaced
atomically (write a temporary file, then rename), so two processes tuning at once cannot leave it torn
(the later writer wins, which is harmless: both wrote measured values).
"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import tempfile
from typing import Callable, Sequence

import torch

from . import _runtime as rt

Timer = Callable[[Callable[[], None]], float]  # runs fn, returns seconds per call


def default_cache_path() -> pathlib.Path:
    """``~/.cache/pdserve/autotune.json`` (the environment is read only by pdserve/config.py)."""
    return pathlib.Path.home() / ".cache" / "pdserve" / "autotune.json"


def default_candidates(sm_count: int | None = None) -> list[int]:
    """0 (no split) and 1, 2, 4, 8 waves of ``sm_count`` CTAs (the device's SMs by default)."""
    sm = sm_count or rt.multiprocessor_count()
    return [0, sm, 2 * sm, 4 * sm, 8 * sm]


def default_target_ctas(sm_count: int | None = None) -> int:
    """The value used before (or without) tuning: two waves, ``2 * SMs``."""
    return 2 * (sm_count or rt.multiprocessor_count())


def cuda_event_timer(warmup: int = 2, iters: int = 5) -> Timer:
    """Median seconds per call of ``fn`` by CUDA events on the current stream (after ``warmup`` calls)."""

    def timer(fn: Callable[[], None]) -> float:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        return statistics.median(samples)

    return timer


class TargetCtasTuner:
    """Pick and cache ``target_ctas`` per (GPU, kernel, shape).

    Args:
        cache_path: JSON cache file; None = :func:`default_cache_path`; ``""`` disables the file. The engine
            passes ``config.autotune_cache or None`` (the field is empty by default).
        device_name: cache key prefix (default: torch's name for the current CUDA device, or "cpu").
        timer: how a candidate is timed (default :func:`cuda_event_timer`); tests pass a fake one.
    """

    def __init__(self, cache_path: str | os.PathLike | None = None, *, device_name: str | None = None,
                 timer: Timer | None = None):
        if cache_path is None:
            self.path: pathlib.Path | None = default_cache_path()
        else:
            self.path = pathlib.Path(cache_path) if cache_path else None
        if device_name is None:
            device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        self.device_name = device_name
        self.timer = timer or cuda_event_timer()
        self.measured: dict[str, dict[int, float]] = {}  # key -> candidate -> seconds (this process only)
        self._cache = self._load()

    def _load(self) -> dict[str, int]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # a torn or foreign file: tune again and overwrite it
        return {k: int(v) for k, v in data.items() if isinstance(v, int)} if isinstance(data, dict) else {}

    def key(self, kernel: str, shape_key: str) -> str:
        return f"{self.device_name}|{kernel}|{shape_key}"

    def cached(self, kernel: str, shape_key: str) -> int | None:
        return self._cache.get(self.key(kernel, shape_key))

    def best(self, kernel: str, shape_key: str, run: Callable[[int], None],
             candidates: Sequence[int] | None = None) -> int:
        """The cached ``target_ctas`` for (``kernel``, ``shape_key``), else time ``run(target_ctas)`` for each
        candidate, cache the fastest and return it. Candidates that raise are skipped; if all raise, the
        last error propagates."""
        k = self.key(kernel, shape_key)
        if k in self._cache:
            return self._cache[k]
        times: dict[int, float] = {}
        error: Exception | None = None
        for c in (candidates if candidates is not None else default_candidates()):
            try:
                times[int(c)] = float(self.timer(lambda c=c: run(int(c))))
            except Exception as exc:  # noqa: BLE001 - e.g. a launch config a device rejects
                error = exc
        if not times:
            assert error is not None
            raise error
        best = min(times, key=lambda c: (times[c], c))
        self.measured[k] = times
        self._cache[k] = best
        self._save()
        return best

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        merged = self._load()  # keep what other processes tuned meanwhile
        merged.update(self._cache)
        self._cache = merged
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".autotune.", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self._cache, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
