"""The code's shape, checked by reading it: the lifecycle declared once, no import cycle between the top-level
packages, no sprawling functions, and docs/architecture.md's state table equal to ipc/lifecycle.py."""
from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

import pytest

from ipc.lifecycle import LIFECYCLE

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("actors", "api", "gpu", "ipc", "pdserve", "tools", "bench")
# Entry points sit above every package (the command line starts the supervisor): their own node in the graph.
ENTRY_MODULES = {"pdserve.cli"}
MAX_FUNCTION_LINES = 80
LIFECYCLE_FACTS = {"ALLOWED", "FINAL_STATES", "LIVE_STATES", "STAGE_NAME", "STAGE_TIMEOUT_FIELD", "RENEWABLE_STATES",
                   "GAUGE_STATES", "HELD_STATES_BY_ROLE"}


def sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def node_of(module: str) -> str:
    return module if module in ENTRY_MODULES else module.split(".")[0]


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for path, tree in sources():
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        here = node_of(module)
        for node in ast.walk(tree):   # lazy imports inside functions count too
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                there = node_of(name)
                if there.split(".")[0] in PACKAGES and there != here:
                    graph[here].add(there)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def test_no_import_cycle_between_the_top_level_packages():
    graph = import_graph()
    assert graph["api"] >= {"actors", "ipc"}, "the walk found nothing: it reads no imports"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_function_over_80_lines_outside_the_gpu_kernels():
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in sources() if "gpu/kernels" not in path.as_posix()
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_each_per_state_fact_is_declared_only_in_ipc_lifecycle():
    declared = [f"{path.relative_to(ROOT)}:{node.lineno} {target.id}"
                for path, tree in sources() if path.name != "lifecycle.py"
                for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(target, ast.Name) and target.id in LIFECYCLE_FACTS]
    assert not declared, declared
    enum_classes = [f"{path.relative_to(ROOT)}" for path, tree in sources() if path.name != "lifecycle.py"
                    for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == "RequestState"]
    assert not enum_classes, enum_classes


def test_the_architecture_docs_state_table_is_the_lifecycle_table():
    text = (ROOT / "docs" / "architecture.md").read_text()
    documented = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] in {s.state.name for s in LIFECYCLE}:
            documented[cells[0]] = cells[1:7]
    expected = {s.state.name: [s.stage or "-", f"`{s.timeout_field}`" if s.timeout_field else "-", s.renewal or "-",
                               ", ".join(s.gauges) or "-", ", ".join(s.held_by) or "-", ", ".join(s.moved_by)]
                for s in LIFECYCLE}
    assert documented == expected


def test_stage_names_in_504_messages_metrics_and_inspect_come_from_the_lifecycle():
    from actors.watchdog import Expired
    from ipc.lifecycle import STAGE_NAME, RequestState

    message = Expired(0, 1, RequestState.TRANSFERRING, 3.0, 2.0, "stage_deadline", 1, "r").message()
    assert "stage transfer" in message
    for path in (ROOT / "api" / "metrics.py", ROOT / "api" / "debug_state.py"):   # debug_state: inspect's
        assert re.search(r"\bSTAGE_NAME\b", path.read_text()), f"{path.name} does not name stages by STAGE_NAME"
    assert set(STAGE_NAME.values()) == {"queued", "prefill", "bootstrap", "transfer", "decode_waiting", "decode"}


# who may move or take a state-table row: the cores, the API's admission core, the monitor and the supervisor
ROW_MOVERS = {"actors/prefill_core.py", "actors/decode_core.py", "api/admission.py", "actors/monitor.py",
              "actors/supervisor.py"}
# who else calls a KV block allocator's allocate: the allocators themselves and their decorator (ipc/kv_pool.py,
# actors/prefix_cache.py), and the warm-up pass that takes one scratch block before serving (actors/model_runner.py)
BLOCK_ALLOCATORS = {"ipc/kv_pool.py", "actors/prefix_cache.py", "actors/model_runner.py"}
# ipc/_shm.py is ipc's own base; bench/ipc.py measures its primitives against a raw-segment baseline
SHM_IMPORTERS = {"bench/ipc.py"}


def method_calls(name: str) -> list[tuple[str, int, str]]:
    """``(path, line, receiver source)`` of every ``<receiver>.<name>(...)`` call in the packages."""
    calls = []
    for path, tree in sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name:
                calls.append((path.relative_to(ROOT).as_posix(), node.lineno, ast.unparse(node.func.value)))
    return calls


def test_rows_are_moved_and_taken_only_by_the_cores_admission_the_monitor_and_the_supervisor():
    transitions = method_calls("transition")
    assert {p for p, _, _ in transitions} >= {"actors/decode_core.py", "api/admission.py"}, "the walk found none"
    outside = [f"{p}:{line}" for p, line, _ in transitions if p not in ROW_MOVERS]
    assert not outside, f"transition() outside the cores: {outside}"
    allocations = method_calls("allocate")
    rows = [f"{p}:{line}" for p, line, receiver in allocations if "table" in receiver and p not in ROW_MOVERS]
    blocks = [f"{p}:{line}" for p, line, receiver in allocations if "table" not in receiver
              and p not in ROW_MOVERS | BLOCK_ALLOCATORS]
    assert not rows and not blocks, f"allocate() outside the cores: {rows + blocks}"


def test_ipc_shm_is_imported_only_inside_ipc():
    importers = []
    for path, tree in sources():
        where = path.relative_to(ROOT).as_posix()
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] + [node.module] \
                if isinstance(node, ast.ImportFrom) and node.module else []
            if any(n == "ipc._shm" or n.startswith("ipc._shm.") for n in names):
                importers.append(f"{where}:{node.lineno}")
    outside = [i for i in importers if not i.startswith("ipc/") and i.split(":")[0] not in SHM_IMPORTERS]
    assert importers and not outside, outside


def test_one_reservation_formula():
    """``ceil((prompt + max_tokens) / block_tokens)`` is pdserve.kv_budget.blocks_for's alone."""
    def divides_tokens_by_blocks(node) -> bool:
        return isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.FloorDiv)) and \
            "max_tokens" in ast.unparse(node.left)

    written = [f"{path.relative_to(ROOT)}:{node.lineno}" for path, tree in sources()
               for node in ast.walk(tree) if divides_tokens_by_blocks(node)]
    assert [w.split(":")[0] for w in written] == ["pdserve/kv_budget.py"], written


def test_every_transition_in_the_engine_names_its_role_and_the_table_checks_it_against_the_lifecycle():
    from ipc.lifecycle import SPEC, RequestState, check_mover

    unnamed = []
    for path, tree in sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "transition":
                by = [k.value for k in node.keywords if k.arg == "by"]
                if not by or not (isinstance(by[0], ast.Constant) or path.name == "monitor.py"):
                    unnamed.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not unnamed, f"transition() without a literal by=role: {unnamed}"
    check_mover(RequestState.DECODING, "decode")
    for state, role in ((RequestState.DECODING, "api"), (RequestState.QUEUED, "prefill"),
                        (RequestState.TIMED_OUT, "decode"), (RequestState.ABORTED, "monitor")):
        assert role not in SPEC[state].moved_by
        with pytest.raises(ValueError, match="may not move"):
            check_mover(state, role)


def module_level_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, module)`` of the imports that run when the module is imported (not inside a function or an
    ``if TYPE_CHECKING:`` block)."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or \
                isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
        todo.extend(ast.iter_child_nodes(node))
    return found


def test_ipc_imports_neither_torch_nor_gpu_when_imported():
    heavy = [f"{path.relative_to(ROOT)}:{line} {module}" for path, tree in sources()
             if path.relative_to(ROOT).parts[0] == "ipc"
             for line, module in module_level_imports(tree) if module.split(".")[0] in ("torch", "gpu")]
    assert not heavy, heavy
    assert ("numpy" in {m for _, m in module_level_imports(ast.parse((ROOT / "ipc" / "kv_pool.py").read_text()))})


# the state row's actor fields and the addresses messages carry: their values that name no actor of this engine
ACTOR_VALUE_NAMES = re.compile(r"(prefill_actor|decode_actor|handoff_from|peer|dest)$")


def negative_int(node) -> bool:
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant)


def names_an_actor_value(node) -> bool:
    return isinstance(node, (ast.Name, ast.Attribute, ast.arg)) and bool(ACTOR_VALUE_NAMES.search(
        node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else node.arg))


def actor_sentinels(tree: ast.Module) -> list[int]:
    """Lines where an actor field or address is compared with, defaults to, or is given a negative integer, or a
    constant named ``*_ACTOR`` is assigned one."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(negative_int(n) for n in [node.left, *node.comparators]) and \
                any(names_an_actor_value(n) for n in [node.left, *node.comparators]):
            lines.append(node.lineno)
        elif isinstance(node, ast.keyword) and node.arg and ACTOR_VALUE_NAMES.search(node.arg) and \
                negative_int(node.value):
            lines.append(node.value.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args
            pairs = list(zip(args[len(args) - len(node.args.defaults):], node.args.defaults)) + \
                [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
            lines += [d.lineno for a, d in pairs if names_an_actor_value(a) and negative_int(d)]
        elif isinstance(node, ast.BinOp) and negative_int(node.left):   # -100 - k: a family of sentinels
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and negative_int(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and (t.id.endswith("_ACTOR") or names_an_actor_value(t)) for t in targets):
                lines.append(node.lineno)
    return lines


def test_negative_actor_values_and_address_kinds_are_declared_only_in_the_topology_module():
    """Sentinels such as ``REMOTE_ACTOR = -2`` or ``-100 - k`` live in actors/topology.py; elsewhere code names
    them (``NO_ACTOR``, ``REMOTE``, ``peer_address(k)``). Two ipc record layouts keep their own encodings (ipc
    does not import actors): the state row's "-1 = none" default, which the topology's NO_ACTOR names, and the
    recorder's ``SUPERVISOR_ACTOR`` (an event's writer that has no actor-table row)."""
    from actors.topology import NO_ACTOR
    from ipc.state_table import StateTable

    found = [f"{path.relative_to(ROOT)}:{line}" for path, tree in sources()
             if path.relative_to(ROOT).as_posix() not in {"actors/topology.py", "ipc/state_table.py", "ipc/recorder.py"}
             for line in actor_sentinels(tree)]
    assert not found, f"negative actor values outside actors/topology.py: {found}"
    import inspect
    defaults = inspect.signature(StateTable.allocate).parameters
    assert defaults["prefill_actor"].default == defaults["decode_actor"].default == NO_ACTOR
    kinds = [f"{path.relative_to(ROOT)}:{node.lineno}" for path, tree in sources()
             if path.relative_to(ROOT).as_posix() != "actors/topology.py"
             for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and re.fullmatch(r"(local|peer):\w*", node.value)]
    assert not kinds, f"address kinds spelled outside actors/topology.py: {kinds}"


def test_the_sentinel_finder_finds_the_old_spellings():
    old = ast.parse("REMOTE_ACTOR = -2\n"
                    "def f(peer: int = -1): pass\n"
                    "if ready.prefill_actor == -1: pass\n"
                    "KVReady(prefill_actor=-2)\n"
                    "key = -100 - len(peers)\n"
                    "dest = 'decode' if request.decode_actor == -1 else request.decode_actor\n")
    assert sorted(actor_sentinels(old)) == [1, 2, 3, 4, 5, 6]


# the one door to the numba kernels (gpu/kernels): the CUDA executor, beside the kernels' own package and tests;
# bench/gpu.py measures the kernels themselves
KERNEL_IMPORTERS = {"gpu/exec_cuda.py", "tests/gpu/test_kernels_cudasim.py", "bench/gpu.py"}


def imported_modules(path: Path, tree: ast.Module) -> set[str]:
    """Every module ``tree`` (the file at ``path``) imports, lazily too, relative imports resolved."""
    package = list(path.relative_to(ROOT).with_suffix("").parts)[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)   # from gpu import kernels
    return found


def kernel_importers() -> set[str]:
    files = [path for path in sorted(ROOT.rglob("*.py")) if path.parts[len(ROOT.parts)] in PACKAGES + ("tests",)]
    return {path.relative_to(ROOT).as_posix() for path in files if "gpu/kernels/" not in path.as_posix()
            and any(m == "gpu.kernels" or m.startswith("gpu.kernels.")
                    for m in imported_modules(path, ast.parse(path.read_text(), str(path))))}


def test_only_the_cuda_executor_imports_the_numba_kernels():
    found = kernel_importers()
    assert "gpu/exec_cuda.py" in found, "the walk found no importer: it reads no imports"
    assert found <= KERNEL_IMPORTERS, sorted(found - KERNEL_IMPORTERS)


def api_module_graph() -> dict[str, set[str]]:
    """Module -> the ``api`` modules it imports (at any depth of the file: lazy imports count too)."""
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for path, tree in sources():
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if not module.startswith("api"):
            continue
        graph[module]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # ``from api.dialects import openai`` imports the module api.dialects.openai
                names = [f"{node.module}.{a.name}" if (ROOT / node.module.replace(".", "/") / f"{a.name}.py").exists()
                         else node.module for a in node.names]
            else:
                names = []
            graph[module] |= {n for n in names if n.split(".")[0] == "api" and n != module}
    return graph


# the two processes that serve the app (the API actor, `pdserve router`) sit above it
APP_SERVERS = {"api.server", "api.router_server"}


def test_no_api_module_imports_the_app_but_the_processes_that_serve_it():
    graph = api_module_graph()
    assert "api.protocol" in graph["api.app"] | graph["api.exchange"], "the walk found nothing"
    importers = sorted(m for m, there in graph.items() if "api.app" in there and m not in APP_SERVERS)
    assert not importers, importers


def test_api_has_no_import_cycle_between_its_modules():
    graph = api_module_graph()
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_a_requests_end_is_written_only_in_the_exchange():
    """``http.disconnect``, ``finish_all`` (the release of an HTTP request's rows) and the recorder's CLOSED event
    appear in api/exchange.py alone (api/node_api.py, the /internal/* protocol between nodes, ends its own rows)."""
    found = collections.defaultdict(set)
    for path, tree in sources():
        where = path.relative_to(ROOT).as_posix()
        if not where.startswith("api/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == "http.disconnect":
                found["http.disconnect"].add(where)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "finish_all" and where != "api/node_api.py":
                found["finish_all"].add(where)
            elif isinstance(node, ast.Attribute) and node.attr == "CLOSED" and ast.unparse(node.value) == "EventKind":
                found["CLOSED"].add(where)
    assert dict(found) == {name: {"api/exchange.py"} for name in ("http.disconnect", "finish_all", "CLOSED")}


def test_no_dialect_imports_starlette_responses_or_the_recorder():
    graph = {m: there for m, there in import_names_by_module().items() if m.startswith("api.dialects")}
    assert "api.dialects.anthropic" in graph, "the walk found no dialect"
    bad = {m: sorted(n for n in names if n.startswith(("starlette.responses", "ipc.recorder")))
           for m, names in graph.items()}
    assert not any(bad.values()), bad


def import_names_by_module() -> dict[str, set[str]]:
    """Module -> every module name it imports (``from x import y``: x)."""
    names: dict[str, set[str]] = collections.defaultdict(set)
    for path, tree in sources():
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names[module] |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names[module].add(node.module)
    return names


def test_the_app_module_is_the_route_table_and_the_routes_that_generate_nothing():
    assert len((ROOT / "api" / "app.py").read_text().splitlines()) < 300
    assert not (ROOT / "api" / "dialects" / "routes.py").exists()   # every dialect's life is api/exchange.py's


def test_the_installed_wheel_holds_no_benchmark():
    """setup.cfg's packages leave bench/ out, and tools/ (shipped: what users run) holds no bench script."""
    import configparser
    import fnmatch

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    include = [p.strip() for p in cfg["options.packages.find"]["include"].split(",")]
    assert "tools*" in include and not any(fnmatch.fnmatch(name, pattern) for pattern in include
                                           for name in ("bench", "bench.anchors"))
    assert not sorted(p.name for p in (ROOT / "tools").glob("bench_*"))


def test_one_sampling_type_from_the_http_body_to_the_sampler():
    from actors.messages import Sampling as wire
    from gpu.sampling import Sampling as sampler
    from pdserve.sampling import Sampling

    assert wire is sampler is Sampling
    declared = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name}" for path, tree in sources()
                for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and "Sampling" in node.name
                and path.relative_to(ROOT).as_posix() != "pdserve/sampling.py"]
    assert not declared, declared
