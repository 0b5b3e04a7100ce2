"""Two network namespaces on this machine standing in for a prefill host and a decode host (issue 15); used by
the multinode tests (tests/multinode) and the benchmarks that cross them (bench/kv_network ``--netns``,
bench/multinode).

Layout (``k`` picked so that neither 10.77.k.0/24 nor 10.78.k.0/24 overlaps an address or route of the machine)::

    root namespace: bridge pdbr<tag> 10.77.k.1/24      the router and the test client live here
      |- veth pdc<tag>p <-> ctl0  10.77.k.2/24 in pdsv-<tag>-p    control: the nodes' HTTP ports
      '- veth pdc<tag>d <-> ctl0  10.77.k.3/24 in pdsv-<tag>-d
    pdsv-<tag>-p data0 10.78.k.2/24 <-> data0 10.78.k.3/24 pdsv-<tag>-d    data: the KV (Mooncake TCP)

Neither namespace has a default route and nothing is forwarded, so no packet leaves the machine. Everything is
plain ``ip`` (iproute2) calls; creating namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN).
"""
from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import warnings
import weakref
from pathlib import Path

from bench.engine_process import terminate, wait_until

NS_PREFIX = "pdsv-"
BRIDGE_PREFIX = "pdbr"
CONTROL_VETH_PREFIX = "pdc"
IFNAMSIZ = 15   # the kernel's limit on an interface name, in characters (16 bytes with the NUL)
# Netns and root-side link names carry the creating process's pid: "<pid>x<counter>".
_STALE_NS = re.compile(r"^pdsv-(\d+)x\d+-\w+$")
_STALE_LINK = re.compile(r"^(?:pdbr|pdc)(\d+)x\d+[pd]?$")
_COUNTER = itertools.count()
_IP_TIMEOUT_S = 20.0
_LOCK_PATH = Path(tempfile.gettempdir()) / "pdsv-netns.lock"   # serialises picking k between processes
ROOT = Path(__file__).resolve().parent.parent


class NetnsError(RuntimeError):
    """An ``ip`` command failed, or ``close()`` found something it could not delete."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip *args``; NetnsError with its stderr when ``check`` and it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _new_tag() -> str:
    return f"{os.getpid()}x{next(_COUNTER)}"


def exec_argv(ns: str, argv: list[str]) -> list[str]:
    """``argv`` run inside network namespace ``ns`` (``ip netns exec`` execs it: same pid, no extra fork)."""
    return ["ip", "netns", "exec", ns, *argv]


def can_create_netns() -> tuple[bool, str]:
    """Whether this process can build a TwoHostNet: ``(True, "")``, or ``(False, why)`` when not root, without
    the ``ip`` binary, or when the kernel refuses a namespace, a veth pair or a bridge (tried for real in a
    throwaway namespace, deleted again)."""
    if os.geteuid() != 0:
        return False, f"network namespaces need root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return False, "no `ip` binary on PATH (Debian package iproute2)"
    probe = f"{NS_PREFIX}{_new_tag()}-t"
    try:
        _ip("netns", "add", probe)
    except (NetnsError, OSError, subprocess.SubprocessError) as exc:
        return False, f"the kernel refused a network namespace: {exc}"
    try:
        _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
    except (NetnsError, OSError, subprocess.SubprocessError) as exc:
        return False, f"the kernel refused a veth pair or a bridge: {exc}"
    finally:
        _ip("netns", "del", probe, check=False)
    return True, ""


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network of the root namespace's addresses and routes (all tables), default routes left out."""
    words = [line.split() for line in _ip("-4", "-o", "addr", "show").stdout.splitlines()]
    found = [w[w.index("inet") + 1] for w in words if "inet" in w]
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        found.extend(line.split()[:2])   # "10.0.0.0/8 dev ..." or "local 10.0.0.1 dev ..."
    networks = []
    for text in found:
        with contextlib.suppress(ValueError):
            net = ipaddress.ip_network(text, strict=False)
            if net.version == 4 and net.prefixlen > 0:
                networks.append(net)
    return networks


def _free_k() -> int:
    """The lowest k in 1..254 with 10.77.k.0/24 and 10.78.k.0/24 overlapping nothing in use."""
    used = _networks_in_use()
    for k in range(1, 255):
        mine = (ipaddress.ip_network(f"10.77.{k}.0/24"), ipaddress.ip_network(f"10.78.{k}.0/24"))
        if not any(a.overlaps(b) for a in mine for b in used):
            return k
    raise NetnsError("no free 10.77.k.0/24 + 10.78.k.0/24 pair of subnets (k in 1..254)")


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL whatever still runs inside ``ns`` (only this harness starts processes there)."""
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _delete_all(namespaces: tuple[str, ...], root_links: tuple[str, ...]) -> list[str]:
    """Delete ``root_links`` (a veth's peer goes with it, synchronously) and ``namespaces`` (after killing their
    processes), whatever exists of them; returns the names still present afterwards."""
    for ns in namespaces:
        _kill_namespace_processes(ns)
        _ip("-n", ns, "link", "del", "data0", check=False)   # synchronous, unlike the namespace's own teardown
    for link in root_links:
        _ip("link", "del", link, check=False)
    for ns in namespaces:
        _ip("netns", "del", ns, check=False)
    present_ns = {line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line}
    present_links = _root_link_names()
    return sorted((present_ns & set(namespaces)) | (present_links & set(root_links)))


def _root_link_names() -> set[str]:
    """Names of the root namespace's links (a veth shows as ``name@peer``: the part before ``@``)."""
    lines = _ip("-o", "link", "show", check=False).stdout.splitlines()
    return {line.split(":")[1].strip().split("@")[0] for line in lines if line.count(":") >= 2}


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"   # the field after "(comm)" is the state


def sweep_stale() -> list[str]:
    """Delete the ``pdsv-*`` namespaces and ``pdbr*``/``pdc*`` links left by an earlier run whose process is
    gone (killed before its finalizer ran); returns the names it found. Those of live processes are left."""
    namespaces = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line]
    stale_ns = tuple(n for n in namespaces if (m := _STALE_NS.match(n)) and not _pid_alive(int(m.group(1))))
    stale_links = tuple(n for n in sorted(_root_link_names())
                        if (m := _STALE_LINK.match(n)) and not _pid_alive(int(m.group(1))))
    if stale_ns or stale_links:
        _delete_all(stale_ns, stale_links)
    return sorted(stale_ns + stale_links)


class TwoHostNet:
    """A prefill "host" and a decode "host" as two network namespaces (layout: this module's docstring).

    Built on construction; ``close()`` (also ``__exit__``, and a finalizer at interpreter exit as a last resort)
    deletes the namespaces, veths and bridge whatever happened, and is idempotent.

    Raises:
        NetnsError: an ``ip`` command failed while building (everything built so far is deleted first).
    """

    exec_argv = staticmethod(exec_argv)

    def __init__(self) -> None:
        self.tag = _new_tag()
        self.prefill_ns = f"{NS_PREFIX}{self.tag}-p"
        self.decode_ns = f"{NS_PREFIX}{self.tag}-d"
        self.bridge = f"{BRIDGE_PREFIX}{self.tag}"
        self._control_veths = {self.prefill_ns: f"{CONTROL_VETH_PREFIX}{self.tag}p",
                               self.decode_ns: f"{CONTROL_VETH_PREFIX}{self.tag}d"}
        too_long = [n for n in (self.bridge, *self._control_veths.values()) if len(n) > IFNAMSIZ]
        if too_long:
            raise NetnsError(f"interface names over {IFNAMSIZ} characters: {too_long}")
        self._finalizer = weakref.finalize(self, _delete_all, (self.prefill_ns, self.decode_ns),
                                           (*self._control_veths.values(), self.bridge))
        try:
            self._build()
        except BaseException:
            self._finalizer()
            raise

    def _build(self) -> None:
        for ns in (self.prefill_ns, self.decode_ns):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        with open(_LOCK_PATH, "a") as lock:   # two runs must not pick the same k before either's bridge exists
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.k = _free_k()
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"10.77.{self.k}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self.root_addr = f"10.77.{self.k}.1"
        self.prefill_addr, self.decode_addr = f"10.77.{self.k}.2", f"10.77.{self.k}.3"
        self.prefill_data_addr, self.decode_data_addr = f"10.78.{self.k}.2", f"10.78.{self.k}.3"
        for ns, addr in ((self.prefill_ns, self.prefill_addr), (self.decode_ns, self.decode_addr)):
            veth = self._control_veths[ns]
            _ip("link", "add", veth, "type", "veth", "peer", "name", "ctl0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "ctl0")
            _ip("-n", ns, "link", "set", "ctl0", "up")
        _ip("-n", self.prefill_ns, "link", "add", "data0", "type", "veth", "peer", "name", "data0",
            "netns", self.decode_ns)
        for ns, addr in ((self.prefill_ns, self.prefill_data_addr), (self.decode_ns, self.decode_data_addr)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "data0")
        self.data_link(True)

    def data_link(self, up: bool, timeout_s: float = 10.0) -> None:
        """Set both ends of the data veth up or down (the "link set down" fault). Going up returns once both
        ends report carrier (LOWER_UP); AssertionError if that takes over ``timeout_s``."""
        for ns in (self.prefill_ns, self.decode_ns):
            _ip("-n", ns, "link", "set", "data0", "up" if up else "down")
        if up:
            def carrier():
                return all("LOWER_UP" in _ip("-n", ns, "-o", "link", "show", "data0").stdout
                           for ns in (self.prefill_ns, self.decode_ns))
            wait_until(carrier, timeout_s, 0.05, "the data veth's carrier")

    def close(self) -> None:
        """Delete both namespaces (killing what still runs in them), the veths and the bridge. Idempotent.

        Raises:
            NetnsError: something of this net still exists after the deletions (names it).
        """
        leftovers = self._finalizer()   # None on every call after the first
        if leftovers:
            raise NetnsError(f"still present after close(): {leftovers}")

    def __enter__(self) -> "TwoHostNet":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except NetnsError as error:
            if exc_type is None:
                raise
            warnings.warn(f"{error} (while handling {exc_type.__name__})")   # keep the original exception


def start_in_namespace(ns: str, argv: list[str], log_path: Path | str, env: dict[str, str] | None = None,
                       ) -> subprocess.Popen:
    """Start ``argv`` inside network namespace ``ns`` from the repository root, stdout and stderr to
    ``log_path``; ``env`` on top of this process's environment without its PDSERVE_* variables."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    full_env.update(env or {})
    with open(log_path, "wb") as log:
        return subprocess.Popen(exec_argv(ns, argv), cwd=ROOT, env=full_env, stdout=log,
                                stderr=subprocess.STDOUT)


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM, wait up to ``timeout_s``, SIGKILL, reap; returns the exit code (negative: the signal)."""
    terminate(proc, timeout_s)
    return proc.returncode


def wait_http_ok(url: str, deadline_s: float, proc: subprocess.Popen | None = None, verify=True) -> None:
    """Poll GET ``url`` (no proxy: the namespaces' addresses are local) until it answers 200; ``verify``: httpx's
    (an ssl.SSLContext for an https:// node with a private CA or mutual TLS).

    Raises:
        AssertionError: no 200 within ``deadline_s`` seconds.
        RuntimeError: ``proc`` (the server, if given) exited first.
    """
    import httpx

    def answered():
        if proc is not None and proc.poll() is not None:
            return "exited"
        return httpx.get(url, timeout=2, trust_env=False, verify=verify).status_code == 200

    if wait_until(answered, deadline_s, 0.1, f"{url} to answer 200") == "exited":
        raise RuntimeError(f"the server exited with {proc.returncode} before {url} answered")
