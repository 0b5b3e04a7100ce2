"""pdserve behind a real nginx (Debian's package, `make install-nginx`): TLS in front, HTTP/1.1 keep-alive upstream,
unbuffered proxying, as in the outage the connection ledger was built for (docs/architecture.md "The connection
ledger"). Skipped, saying why, without nginx.

Two engines with a slow prefill (fault ``slow_prefill``) behind two nginx servers with ``proxy_read_timeout`` half
the prefill: one sends SSE pings, one does not (``sse_ping_interval_s 0``)."""
from __future__ import annotations

import shutil
import signal
import socket
import ssl
import subprocess

import httpx
import pytest

from api.blame import NONE_US
from ipc.ledger import ConnectionLedger
from tests.conftest import cleanup_engine, free_port, start_engine
from tests.e2e.test_connections import h11_body, h11_post, sse_tokens
from tests.e2e.test_openai_api import self_signed
from bench.engine_process import wait_until

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if shutil.os.path.exists("/usr/sbin/nginx") else None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (make install-nginx: Debian's package)")

PREFILL_S = 8.0            # the silent prefill (the 10 s, shortened for the suite's time)
PROXY_READ_TIMEOUT_S = 4   # nginx gives up on an upstream silent this long
STALL_S = 2.0
# the stopped reader's stream: echo + logprobs of a long prompt for 8 choices, ~10 MB of SSE, more than the socket
# buffers on both sides of nginx (tcp_wmem's 4 MiB cap each; nginx's client side is capped by sndbuf= below) hold
PROMPT_TOKENS = 1500
TICK_S = 0.5
RESUME_RCVBUF_BYTES = 1 << 20

NGINX_CONF = """
worker_processes 1;
user root;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy; fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
    upstream pdserve {{ server 127.0.0.1:{upstream}; keepalive 8; keepalive_timeout 60s; }}
    server {{
        listen 127.0.0.1:{port} ssl sndbuf=32k;
        ssl_certificate {cert}; ssl_certificate_key {key};
        location / {{
            proxy_pass http://pdserve;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header X-Forwarded-For $remote_addr;
            proxy_set_header X-Request-Start "t=${{msec}}";
            proxy_buffering off;
            proxy_read_timeout {read_timeout}s;
        }}
    }}
}}
"""


class Nginx:
    def __init__(self, tmp, upstream_port: int, cert, key):
        self.port = free_port()
        tmp.mkdir(parents=True, exist_ok=True)
        conf = tmp / "nginx.conf"
        conf.write_text(NGINX_CONF.format(tmp=tmp, upstream=upstream_port, port=self.port, cert=cert, key=key,
                                          read_timeout=PROXY_READ_TIMEOUT_S))
        self.error_log = tmp / "error.log"
        self.proc = subprocess.Popen([NGINX, "-p", str(tmp), "-c", str(conf), "-g", "daemon off;"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_until(self.listening, 20, 0.05, "nginx to listen")

    def listening(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"nginx exited: {self.proc.stderr.read().decode(errors='replace')}")
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGQUIT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("tls"))


def _engine_behind_nginx(tmp_path_factory, tls, name: str, ping_s: float):
    eng = start_engine(tmp_path_factory.mktemp(name), "--http-stall-s", str(STALL_S), "--sse-ping-interval-s",
                       str(ping_s), env={"PDSERVE_MONITOR_TICK_S": str(TICK_S),
                                         "PDSERVE_FAULTS": f"slow_prefill:seconds={PREFILL_S},match=slowp-"})
    try:
        proxy = Nginx(tmp_path_factory.mktemp(name + "-nginx"), eng.port, *tls)
    except BaseException:
        cleanup_engine(eng)
        raise
    return eng, proxy


@pytest.fixture(scope="module")
def pinged(tmp_path_factory, tls):
    eng, proxy = _engine_behind_nginx(tmp_path_factory, tls, "pinged", 1.0)
    yield eng, proxy
    proxy.stop()
    cleanup_engine(eng)


@pytest.fixture(scope="module")
def silent(tmp_path_factory, tls):
    eng, proxy = _engine_behind_nginx(tmp_path_factory, tls, "silent", 0)
    yield eng, proxy
    proxy.stop()
    cleanup_engine(eng)


def _stream(proxy, request_id: str) -> list[str]:
    with httpx.Client(verify=False, timeout=60) as client:
        with client.stream("POST", proxy.url + "/v1/completions", headers={"x-request-id": request_id},
                           json={"prompt": "Hello", "max_tokens": 3, "stream": True}) as response:
            assert response.status_code == 200
            return [line for line in response.iter_lines() if line]


def test_a_silent_prefill_longer_than_the_proxys_read_timeout_succeeds_with_sse_pings(pinged):
    _, proxy = pinged
    lines = _stream(proxy, "slowp-through-nginx")
    assert lines.count(": ping") >= PREFILL_S - 2 and lines[-1] == "data: [DONE]"


def test_without_sse_pings_the_same_prefill_is_cut_by_the_proxy(silent):
    _, proxy = silent
    with pytest.raises(httpx.RemoteProtocolError):   # nginx closes the stream after proxy_read_timeout
        _stream(proxy, "slowp-unpinged")
    log = proxy.error_log.read_text(errors="replace")
    assert "upstream timed out" in log


def test_a_client_that_stops_reading_through_tls_and_nginx_is_named_and_resumes_whole(pinged, capsys):
    eng, proxy = pinged
    from ipc.naming import segment_name

    ledger = ConnectionLedger.attach(segment_name(eng.engine_id, "conns"), readonly=True)
    rid = "proxied-stopped-reader"
    body = {"prompt": [1000] * PROMPT_TOKENS, "echo": True, "max_tokens": 200, "n": 8, "ignore_eos": True,
            "stream": True, "logprobs": 20, "stream_options": {"include_usage": True}}
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect(("127.0.0.1", proxy.port))
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    sock = context.wrap_socket(raw, server_hostname="localhost")
    try:
        client, request = h11_post(body, rid)
        sock.sendall(request)

        def flagged():
            for r in ledger.live_rows():
                if rid.encode() in list(r["req_id"]) and r["flag_reasons"] & 2:
                    return r
            return None
        row = wait_until(flagged, 180, 0.1, "the upstream connection to be flagged write_blocked")
        assert row["forwarded"] == b"127.0.0.1" and row["protocol"] == 1   # nginx's upstream: HTTP/1.1
        assert f"http write_blocked: connection {int(row['conn_id'])}" in eng.log_text()
        # resume: a 4 KiB receive window over TLS crawls (~10 KB/s, delayed ACKs) through ~10 MB; open it up
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RESUME_RCVBUF_BYTES)
        sock.settimeout(120)
        tokens, usage = sse_tokens(h11_body(client, sock))
        assert usage["completion_tokens"] == 8 * 200
        assert tokens == 8 * (PROMPT_TOKENS + 200)   # nothing lost: every echoed and generated token's entry
    finally:
        sock.close()
        ledger.close()
    # the blame split (api/blame.py): nginx's X-Request-Start, the engine done, then the bytes written to nginx,
    # the last of them held back by the stopped reader: more of the time is outside the engine than in it
    from tools import inspect

    entry = wait_until(lambda: (read_arrivals(eng, rid) or [None])[-1], 30, 0.1, "the request's arrival entry")
    assert entry["status"] == 200 and entry["before_us"] != NONE_US
    assert entry["admitted_us"] < entry["done_us"] < entry["end_us"] != NONE_US
    assert inspect.main([eng.engine_id, "--request", rid]) == 0
    text = capsys.readouterr().out
    assert "after the proxy's X-Request-Start" in text and "last byte handed to the connection at" in text, text


def read_arrivals(eng, rid: str) -> list[dict]:
    from ipc.arrivals import ArrivalIndex
    from ipc.naming import segment_name
    from ipc.recorder import request_key

    with ArrivalIndex.attach(segment_name(eng.engine_id, "arrivals"), readonly=True) as index:
        return index.find(request_key(rid))["arrivals"]
