"""The two-host harness itself, no engine: a TCP listener in the decode namespace is reachable from the prefill
namespace over the data link and from the root namespace over the control bridge; the data link goes down and up
without touching the control link; nothing of a TwoHostNet survives close(), even after an exception."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from tests.conftest import wait_until
from bench.netns import TwoHostNet, can_create_netns, start_in_namespace, stop_process, sweep_stale

PORT = 5555   # free in any fresh namespace
DEADLINE_S = 20.0
# Answers b"pong" to every connection on every address of its namespace, until SIGTERM.
PONG_SERVER = ("import socket\n"
               f"listener = socket.create_server(('0.0.0.0', {PORT}))\n"
               "while True:\n"
               "    conn, _ = listener.accept()\n"
               "    conn.sendall(b'pong')\n"
               "    conn.close()\n")
PONG_CLIENT = ("import socket, sys\n"
               f"with socket.create_connection((sys.argv[1], {PORT}), timeout=2) as s:\n"
               "    sys.stdout.write(s.recv(4).decode())\n")


def pong_from_root(addr: str) -> bool:
    with socket.create_connection((addr, PORT), timeout=2) as s:
        return s.recv(4) == b"pong"


def pong_from(net: TwoHostNet, ns: str, addr: str) -> bool:
    """Whether a client started inside ``ns`` gets the answer from ``addr`` (False on any connect error)."""
    done = subprocess.run(net.exec_argv(ns, [sys.executable, "-c", PONG_CLIENT, addr]), capture_output=True,
                          text=True, timeout=DEADLINE_S)
    return done.returncode == 0 and done.stdout == "pong"


def names_of(tag: str) -> list[str]:
    """Every namespace and root-namespace link whose name carries ``tag`` (not a longer tag: "1x1" vs "1x10")."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return [line for line in (listed + links).splitlines() if re.search(rf"{tag}(?!\d)", line)]


@pytest.fixture(scope="module")
def pong_server(two_host_net, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("netns") / "pong.log"
    proc = start_in_namespace(two_host_net.decode_ns, [sys.executable, "-c", PONG_SERVER], log_path)
    try:
        wait_until(lambda: proc.poll() is None and pong_from_root(two_host_net.decode_addr), DEADLINE_S, 0.1,
                   f"the pong server (log {log_path})")
        yield proc
    finally:
        stop_process(proc, timeout_s=5)


def test_decode_is_reachable_over_the_data_link_from_prefill_and_over_control_from_root(two_host_net,
                                                                                        pong_server):
    net = two_host_net
    assert pong_from(net, net.prefill_ns, net.decode_data_addr)
    assert pong_from(net, net.prefill_ns, net.decode_addr)   # node to node over the bridge too
    assert pong_from_root(net.decode_addr)
    assert net.root_addr != net.prefill_addr != net.decode_addr
    assert net.prefill_data_addr.split(".")[:2] == ["10", "78"] and net.prefill_addr.split(".")[:2] == ["10", "77"]


def test_data_link_down_cuts_the_data_address_only_and_up_restores_it(two_host_net, pong_server):
    net = two_host_net
    try:
        net.data_link(False)
        wait_until(lambda: not pong_from(net, net.prefill_ns, net.decode_data_addr), DEADLINE_S, 0.1,
                   "the data address to become unreachable from prefill")
        assert pong_from_root(net.decode_addr)
        assert pong_from(net, net.prefill_ns, net.decode_addr)
    finally:
        net.data_link(True)
    wait_until(lambda: pong_from(net, net.prefill_ns, net.decode_data_addr), DEADLINE_S, 0.1,
               "the data address to answer prefill again")


def test_close_deletes_namespaces_veths_bridge_and_their_processes_even_after_an_exception(multinode_ready,
                                                                                          tmp_path):
    with pytest.raises(RuntimeError, match="raised inside"):
        with TwoHostNet() as net:
            tag = net.tag
            assert len(names_of(tag)) >= 5   # 2 namespaces, the bridge, 2 control veths
            sleeper = start_in_namespace(net.prefill_ns, ["sleep", "600"], tmp_path / "sleep.log")
            # inside the namespace before close(): `ip netns exec` enters it after fork (a race under load)
            wait_until(lambda: str(sleeper.pid) in subprocess.run(
                ["ip", "netns", "pids", net.prefill_ns], capture_output=True, text=True).stdout.split(),
                DEADLINE_S, 0.02, "the sleeper to enter its namespace")
            raise RuntimeError("raised inside the with block")
    try:
        assert sleeper.wait(timeout=DEADLINE_S) < 0   # killed by close(): it would keep the namespace alive
    finally:
        stop_process(sleeper, timeout_s=1)
    assert names_of(tag) == []
    net.close()   # idempotent
    assert names_of(tag) == []


def test_sweep_stale_removes_what_a_dead_run_left_and_keeps_a_live_runs(two_host_net):
    dead = subprocess.Popen(["true"])
    dead.wait()
    tag = f"{dead.pid}x0"
    created = [["netns", "add", f"pdsv-{tag}-p"], ["link", "add", f"pdbr{tag}", "type", "bridge"]]
    try:
        for args in created:
            subprocess.run(["ip", *args], check=True, capture_output=True)
        swept = sweep_stale()
        assert f"pdsv-{tag}-p" in swept and f"pdbr{tag}" in swept
        assert names_of(tag) == []
        assert len(names_of(two_host_net.tag)) >= 5
    finally:
        subprocess.run(["ip", "netns", "del", f"pdsv-{tag}-p"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"pdbr{tag}"], capture_output=True)


def test_can_create_netns_says_why_not(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert can_create_netns() == (False, "network namespaces need root (running as uid 1000)")
    monkeypatch.undo()
    monkeypatch.setenv("PATH", "")
    ok, reason = can_create_netns()
    assert not ok
    if os.geteuid() == 0:
        assert reason == "no `ip` binary on PATH (Debian package iproute2)"
    else:
        assert reason == f"network namespaces need root (running as uid {os.geteuid()})"
