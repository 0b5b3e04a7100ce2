"""Batch invariance of ``--weights auto`` decode: a row's numbers do not depend on which rows share its call.

The same row is run alone, then at every place (first, second of a pair, the odd last row...) of batches of 1..9
rows whose other rows differ (other inputs, other lengths), and its outputs must be bit-identical: for the Q4 and
Q8 GEMVs, for ``lowbit_cpu.decode_layers``, and for whole decode steps (logits) of the embedded model (one-call
path and op-by-op path) and of tiny low-bit models of the other families, serially and with the GEMVs' tiles over
two threads (``lowbit_cpu.set_threads``; the decode actor's choice per step), over float16 KV caches (the default
of these weights, ``kv_cache_dtype``) and float32 ones. The kernels are checked in a fresh
process with an empty numba cache that compiles ``decode_layers`` first, as the decode actor does: numba lets a
callee inherit its caller's ``fastmath``, so what a kernel computes once depended on who compiled it first.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu.model import DENSE_MIN_TOKENS, LlamaModel, kv_pool_shape
from tests.gpu.tiny_families import build_hf, write_gguf

ROOT = Path(__file__).resolve().parents[2]
MAX_ROWS = 9

_KERNEL_SCRIPT = r"""
import json, sys
import numpy as np, torch
from gpu import lowbit_cpu as lb

rng = np.random.default_rng(0)
L, hidden, H, Hkv, D, inter, BT = 2, 64, 2, 1, 32, 96, 16

def q4(n, k):
    t = lb.q4_tiles(torch.from_numpy(rng.integers(0, 16, (n, k)).astype(np.uint8)),
                    torch.from_numpy(rng.random((n, k // 32)).astype(np.float32) * 0.05),
                    torch.from_numpy(rng.standard_normal((n, k // 32)).astype(np.float32) * 0.05))
    return tuple(t[key] for key in ("tiles", "tile_scale", "tile_min"))

layers = {name: [q4(n, k) for _ in range(L)] for name, n, k in
          (("qkv", (H + 2 * Hkv) * D, hidden), ("o", hidden, H * D), ("gate_up", 2 * inter, hidden),
           ("down", hidden, inter))}
stacked = [tuple(torch.stack([lay[i] for lay in layers[n]]).numpy() for i in range(3))
           for n in ("qkv", "o", "gate_up", "down")]
norms = [(1 + 0.1 * rng.standard_normal((L, hidden))).astype(np.float32) for _ in range(2)]
cos = np.cos(np.outer(np.arange(64), rng.random(D))).astype(np.float32)
sin = np.sin(np.outer(np.arange(64), rng.random(D))).astype(np.float32)
rows = rng.standard_normal((10, hidden)).astype(np.float32)
lengths = [23, 5, 40, 17, 31, 9, 50, 12, 28, 33]   # row 0 is the probe
pool0 = rng.standard_normal((L, 2, 10 * 4 * BT, Hkv, D)).astype(np.float32)
tables = np.arange(40, dtype=np.int64).reshape(10, 4)

pool0_h = pool0.astype(np.float16).view(np.uint16)   # a float16 KV pool, as numba takes it (its bits)

def layers_call(order, parallel=False, half=False):
    x, pool = rows[order].copy(), (pool0_h if half else pool0).copy()
    if parallel:
        lb.set_threads(2)
    lb.decode_layers(x, *norms, *stacked, pool, BT, tables[order], np.asarray(lengths, np.int64)[order], cos, sin,
                     H, inter, np.float32(1e-5), np.float32(D ** -0.5), parallel)
    lb.set_threads(1)
    return x


def threaded(fn):   # a GEMV with its tiles over two threads (lowbit_cpu.set_threads)
    def run(x):
        lb.set_threads(2)
        try:
            return fn(x)
        finally:
            lb.set_threads(1)
    return run

alone = layers_call([0])   # decode_layers is compiled (with its callees) before anything else
alone_h = layers_call([0], half=True)
w4, w8 = layers["gate_up"][0], lb.q8_tiles(torch.from_numpy(rng.integers(-127, 128, (96, hidden)).astype(np.int8)),
                                          torch.from_numpy(rng.random((96, hidden // 32)).astype(np.float32)))
gemvs = {"q4": lambda x: lb.q4_linear(x, 2 * inter, *w4),
         "q8": lambda x: lb.q8_linear(x, 96, w8["tiles"], w8["tile_scale"]),
         "decode_layers": None, "decode_layers_f16": None}
gemvs.update({name + "_threads": threaded(fn) for name, fn in list(gemvs.items()) if fn is not None})
gemvs["decode_layers_threads"] = None
xs = torch.from_numpy(rng.standard_normal((10, hidden)).astype(np.float32))
bad = {name: [] for name in gemvs}
for B in range(1, int(sys.argv[1]) + 1):
    for pos in range(B):
        order = list(range(1, B))
        order.insert(pos, 0)
        if not np.array_equal(layers_call(order)[pos], alone[0]):
            bad["decode_layers"].append([B, pos])
        if not np.array_equal(layers_call(order, True)[pos], alone[0]):
            bad["decode_layers_threads"].append([B, pos])
        if not np.array_equal(layers_call(order, B % 2 == 0, True)[pos], alone_h[0]):
            bad["decode_layers_f16"].append([B, pos])
        for name, fn in gemvs.items():
            if fn is not None and not torch.equal(fn(xs[order])[pos], fn(xs[:1])[0]):
                bad[name].append([B, pos])
print(json.dumps(bad))
"""


def test_kernels_give_a_row_the_same_bits_at_any_place_in_any_batch_whoever_compiled_them_first(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _KERNEL_SCRIPT, str(MAX_ROWS)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bad = json.loads(proc.stdout.strip().splitlines()[-1])
    assert bad == {name: [] for name in ("q4", "q8", "decode_layers", "decode_layers_f16", "q4_threads",
                                         "q8_threads", "decode_layers_threads")}


_TORCH_THREADS_SCRIPT = r"""
import torch
torch.set_num_threads(1)
from gpu.model import kv_pool_shape
from gpu.prepared import prepared_model
m = prepared_model(None, "auto", "cpu", None)   # the embedded model, as an actor loads it (memory-mapped once built)
kv = torch.zeros(kv_pool_shape(m.config, 5, 16))
m.prefill(kv, [1, 2, 3], [0])   # an actor's warm-up: the first decode step loads the kernels with parallel loops
m.decode(kv, [4], [3], [[0]])
from gpu import lowbit_cpu
lowbit_cpu.set_threads(2)       # and a threaded step of 4 rows, as a decode actor's
m.decode(kv, [4, 5, 6, 7], [3, 3, 3, 3], [[1], [2], [3], [4]])
print(torch.get_num_threads())
"""


def test_numba_s_thread_pool_leaves_torch_s_thread_count_alone():
    """numba's OpenMP layer, started lazily by the first kernel with parallel loops, set the process's OpenMP thread
    count (torch's too) to every CPU: a prefill actor's float32 GEMMs then ran on two threads beside the decode
    actor. lowbit_cpu starts it at import and keeps torch's count."""
    proc = subprocess.run([sys.executable, "-c", _TORCH_THREADS_SCRIPT], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "1"


def _probe_places(model: LlamaModel, block_tokens: int, lengths: list[int], max_rows: int,
                  sizes: tuple[int, ...] = (), kv_dtype: torch.dtype = torch.float32) -> list[tuple]:
    """(rows, place) of every decode step whose probe row (sequence 0) got other logits than alone; the
    sequences (``lengths`` tokens each, prefilled alone into their own blocks) then feed one new token each. Steps
    of 1..``max_rows`` rows, the probe at every place; or with ``sizes`` steps of those sizes, the probe first and
    last."""
    c = model.config
    per_seq = max(lengths) // block_tokens + 1
    tables = [[s * per_seq + j for j in range(per_seq)] for s in range(len(lengths))]
    base = torch.zeros(kv_pool_shape(c, per_seq * len(lengths), block_tokens), dtype=kv_dtype)
    g = torch.Generator().manual_seed(0)
    for n, table in zip(lengths, tables):
        model.prefill(base, torch.randint(3, c.vocab_size, (n,), generator=g).tolist(), table)
    new = torch.randint(3, c.vocab_size, (len(lengths),), generator=g).tolist()

    def step(order: list[int]) -> torch.Tensor:
        return model.decode(base.clone(), [new[i] for i in order], [lengths[i] for i in order],
                            [tables[i] for i in order])

    alone = step([0])[0]
    bad = []
    for rows in sizes or range(1, max_rows + 1):
        for place in (0, rows - 1) if sizes else range(rows):
            order = list(range(1, rows))
            order.insert(place, 0)
            if not torch.equal(step(order)[place], alone):
                bad.append((rows, place))
    return bad


@pytest.fixture(scope="module")
def native_model(gguf_path) -> LlamaModel:
    return LlamaModel.from_path(gguf_path, progress=False, weights="auto")


def test_a_full_decode_batch_gives_a_row_the_logits_it_gets_alone(native_model):
    """Steps as wide as a full batch (max_num_seqs, 32 by default) and up to the one-call path's limit (64 rows):
    the output projection must run the same kernel for the probe as alone (its float32 copy over 32-row blocks
    gave 7 of 40 concurrent greedy answers another token)."""
    lengths = [23, 5, 40, 17, 31, 9, 50, 12, 28, 33] * 7
    assert _probe_places(native_model, 16, lengths[:64], 0, sizes=(31, 32, 48, 64)) == []


@pytest.mark.parametrize("rows", [1, 2, 9, 32])
def test_a_decode_step_on_two_threads_gives_every_row_the_logits_of_one_thread(native_model, rows):
    """``lowbit_cpu.set_threads(2)`` (the decode actor's choice while the prefill actor idles) splits the GEMVs'
    tiles and the rows' attention, never a row's sums: the whole step's logits are bit-identical to one thread."""
    from gpu import lowbit_cpu

    m, block_tokens = native_model, 16
    lengths = ([23, 5, 40, 17, 31, 9, 50, 12, 28, 33] * 4)[:rows]
    per_seq = max(lengths) // block_tokens + 1
    tables = [[s * per_seq + j for j in range(per_seq)] for s in range(rows)]
    base = torch.zeros(kv_pool_shape(m.config, per_seq * rows, block_tokens))
    g = torch.Generator().manual_seed(1)
    for n, table in zip(lengths, tables):
        m.prefill(base, torch.randint(3, m.config.vocab_size, (n,), generator=g).tolist(), table)
    new = torch.randint(3, m.config.vocab_size, (rows,), generator=g).tolist()
    one = m.decode(base.clone(), new, lengths, tables)
    try:
        assert lowbit_cpu.set_threads(2) == min(2, lowbit_cpu.numba.config.NUMBA_NUM_THREADS)
        two = m.decode(base.clone(), new, lengths, tables)
    finally:
        lowbit_cpu.set_threads(1)
    assert torch.equal(one, two)


@pytest.mark.parametrize("name", ["embedded", "mistral", "gemma2"])
def test_a_prefill_pass_on_two_torch_threads_writes_the_kv_and_logits_of_one_thread(native_model, name, tmp_path,
                                                                                     monkeypatch):
    """``prefill_forward(..., threads=2)`` (the prefill actor's choice while the decode actors idle) runs a native
    model's float32 GEMMs on two torch threads as gpu.model.gemm_plan finds them: the bits of one thread (MKL's
    GEMM over 5 to 11 rows differs), in packed passes of an odd number of rows (an activation over all of them on two threads
    splits its work where the threads do, and differs), with an echo, a chunk after a cached prefix and a 7-token
    prompt; on the embedded model and tiny models with other MLPs (GELU) and windows."""
    from gpu import model as model_module

    if name == "embedded":
        m = native_model
    else:
        m = LlamaModel.from_path(write_gguf(name, build_hf(name), tmp_path / f"tiny-{name}-q4.gguf",
                                            linear_type="Q4_0"), progress=False, weights="auto")
    asked = []
    real = model_module.torch_threads

    def recorded(n):
        asked.append(n)
        return real(n)

    monkeypatch.setattr(model_module, "torch_threads", recorded)
    before = torch.get_num_threads()
    torch.set_num_threads(1)   # an actor's torch_threads
    try:
        _check_prefill_threads(m, asked)
    finally:
        torch.set_num_threads(before)


def _check_prefill_threads(m: LlamaModel, asked: list) -> None:
    from actors.model_runner import prefill_forward

    c = m.config
    g = torch.Generator().manual_seed(2)
    a, b, s = (torch.randint(3, c.vocab_size, (n,), generator=g).tolist() for n in (300, 43, 7))
    ta, tb, ts = list(range(19)), list(range(19, 22)), [22]
    passes = {"two prompts, 341 rows": ([], [(a, 0, 300, ta, False), (b, 0, 43, tb, False)]),
              "a chunk after 100 cached and an echo": ([(a, 0, 100, ta, False)],
                                                       [(a, 100, 300, ta, False), (b, 0, 43, tb, True)]),
              "one 7-token prompt": ([], [(s, 0, 7, ts, False)])}
    for label, (cached, chunks) in passes.items():
        runs = []
        for threads in (0, 2):
            kv = torch.zeros(kv_pool_shape(c, 23, 16))
            prefill_forward(m, kv, cached)
            asked.clear()
            outs = prefill_forward(m, kv, chunks, threads)
            # the GEMMs ran on that many threads (gemm_plan also runs its one-thread references)
            assert asked and max(asked) == max(threads, 1) and torch.get_num_threads() == 1, (label, asked)
            runs.append((kv, [o for o, _ in outs]))
        (kv1, out1), (kv2, out2) = runs
        assert torch.equal(kv1, kv2), label
        assert all(x is None and y is None or torch.equal(x, y) for x, y in zip(out1, out2)), label


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("path", ["one_call", "op_by_op"])
def test_a_decode_step_gives_a_row_the_logits_it_gets_alone(native_model, path, kv_dtype):
    """The embedded Q4 model: shorter and longer rows around the probe, 1..9 rows. ``op_by_op`` is the path of
    the non-Llama families (per-row attention over its own keys, the GEMVs one call per linear); over a float16
    KV cache (the default with these weights) and a float32 one."""
    m = native_model
    assert m._stack_layers() is not None
    stacked = m._stacked
    if path == "op_by_op":
        m._stacked = ()   # () = "not applicable": the op-by-op path, on the same kernels
    try:
        assert _probe_places(m, 16, [23, 5, 40, 17, 31, 9, 50, 12, 28, 33], MAX_ROWS, kv_dtype=kv_dtype) == []
    finally:
        m._stacked = stacked


@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3_moe"])
def test_a_decode_step_of_every_family_gives_a_row_the_logits_it_gets_alone(name, tmp_path):
    """Tiny Q4_0 models (tests/gpu/tiny_families.py) with their windows, biases, norms, soft-capping and experts;
    rows longer than the 8-token window too; over a float16 KV cache (their default)."""
    path = write_gguf(name, build_hf(name), tmp_path / f"tiny-{name}-q4.gguf", linear_type="Q4_0")
    m = LlamaModel.from_path(path, progress=False, weights="auto")
    assert _probe_places(m, 4, [13, 3, 21, 9, 17, 6], 6, kv_dtype=torch.float16) == []


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("prefill", ["float32_copies", "low_bit"])
def test_a_prompt_gets_the_same_kv_and_logits_alone_packed_with_others_and_after_a_cache_hit(native_model, prefill,
                                                                                             kv_dtype):
    """Natively, prefill's float32 GEMMs run over fixed blocks of rows (``low_bit``: the engine's default, the
    low-bit GEMVs, row by row) and each token attends over its own keys, so a prompt's KV (every layer, bit for
    bit) and last logits do not depend on the prompts packed with it or on how much of it an earlier prefill (the
    prefix cache) wrote, down to a one-token suffix."""
    m, c = native_model, native_model.config
    m.dense_min_tokens = 1 << 62 if prefill == "low_bit" else DENSE_MIN_TOKENS
    try:
        _check_prompt_invariance(m, c, kv_dtype)
    finally:
        m.dense_min_tokens = DENSE_MIN_TOKENS


def _check_prompt_invariance(m, c, kv_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    prompt, other, short = (torch.randint(3, c.vocab_size, (n,), generator=g).tolist() for n in (45, 30, 7))
    t_prompt, t_other, t_short = [0, 1, 2], [3, 4], [5]

    def pool() -> torch.Tensor:
        return torch.zeros(kv_pool_shape(c, 8, 16), dtype=kv_dtype)

    def prompt_kv(kv: torch.Tensor) -> torch.Tensor:
        return kv[:, :, 0:3].reshape(c.num_layers, 2, 48, -1)[:, :, :45]

    kv = pool()
    alone = m.prefill(kv, prompt, t_prompt)
    ref = prompt_kv(kv).clone()
    runs = {}
    kv = pool()
    runs["packed second of three"] = m.prefill_packed(kv, [other, prompt, short], [t_other, t_prompt, t_short],
                                                      [0, 0, 0])[1], prompt_kv(kv)
    kv = pool()
    runs["packed first"] = m.prefill_packed(kv, [prompt, other], [t_prompt, t_other], [0, 0])[0], prompt_kv(kv)
    for cached in (20, 32, 44):
        kv = pool()
        m.prefill(kv, prompt[:cached], t_prompt)
        runs[f"{cached} cached, packed"] = m.prefill_packed(kv, [short, prompt[cached:]], [t_short, t_prompt],
                                                            [0, cached])[1], prompt_kv(kv)
    assert {name: (torch.equal(logits, alone), torch.equal(kv, ref)) for name, (logits, kv) in runs.items()} == {
        name: (True, True) for name in runs}
