"""`pdserve router`'s view of the nodes: the EngineClient interface api/exchange.py serves from, over the nodes'
``/internal/*`` routes (api/node_api.py) instead of shared memory.

Per request: ``POST /internal/prefill`` on a prefill node (it answers once every choice's KV is ready, with the
KVReady frames and the source pool's Mooncake descriptor), then per choice a streamed ``POST /internal/decode``
on a decode node (it pulls the KV straight from the prefill node over Mooncake and streams tokens back); the
decode node's ``transfer_done`` line is relayed to the prefill node as ``POST /internal/transfer_done`` (it frees
the blocks), a request that ends any other way before that gets ``POST /internal/abort`` there. Which ending owes
which message is api/flight.py's decision; this module carries the effects out.

Deadlines: each node's monitor enforces the stages it holds; the router enforces the whole request's deadline
(``next_event``) and watches the nodes: each is polled every ``monitor_tick_s`` (``GET /internal/status``); one
that has not answered for ``actor_hang_timeout_s`` is marked dead and its requests fail at once (503), the other
node's part of them is aborted. Every call has a timeout; the HTTP client reconnects by itself.

Ejection (actors/ejection.py ``Ejection``, over nodes): a node whose requests time out ``eject_timeouts`` times in
one stage within ``eject_window_s`` (its 504s, read with actors/watchdog.py ``timed_out_stage``) is drained: no new
request goes there, never the last serving node of its role. A node of one side runs no drills, so the router
probes it instead: a tiny real request (``PROBE_PREFIX``, 3 prompt tokens, 2 output tokens) pinned to it, the
other side on a serving node, at once and every ``eject_probe_interval_s``; one that answers readmits the node.

Security: every call carries the router <-> node secret (``Authorization: Bearer <node_secret>``, the only
credential a node's ``/internal/*`` takes), never a client's key; ``https://`` nodes are verified against
``node_ca`` (else the system's store, ``SSL_CERT_FILE``/``SSL_CERT_DIR`` honoured) and, with
``node_client_cert``/``node_client_key``, shown a client certificate (``node_ssl_context``). Whether cleartext is
allowed is decided at start-up (pdserve.cli.node_urls).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import orjson

from actors.ejection import Ejection
from actors.prefix_cache import block_keys
from actors.watchdog import timed_out_stage
from api.admission import AdmissionPolicy, RequestHandle
from api.engine_client import wait_event
from api.flight import Effect, Flight
from api.node_api import request_wire
from api.protocol import GenerationRequest
from api.tracing import INCOMING
from ipc.cache_summary import decode_words, leading_run
from ipc.lifecycle import STAGE_NAME
from pdserve.errors import EngineOverloadedError, InvalidRequestError, PdserveError
from pdserve.faults import PROBE_PREFIX
from pdserve.sampling import Sampling

log = logging.getLogger("pdserve.router")
PROBE_PROMPT_IDS = [1, 2, 3]    # shorter than any KV block: nothing for a prefix cache
_STAGE_STATE = {name: state for state, name in STAGE_NAME.items()}


def node_ssl_context(config):
    """The TLS context the router reaches ``https://`` nodes with: certificates verified (hostname included)
    against ``config.node_ca``, else the system's trust store (OpenSSL's default paths, which honour
    ``SSL_CERT_FILE`` and ``SSL_CERT_DIR``); ``config.node_client_cert``/``node_client_key`` loaded as the client
    certificate when given (httpcore sets ALPN on it per connection: one context per client). Raises ssl.SSLError / OSError for an unreadable or invalid file."""
    import ssl

    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=config.node_ca or None)
    if config.node_client_cert:
        context.load_cert_chain(config.node_client_cert, config.node_client_key or None)
    return context


def node_error(message: str, http_status: int = 503, error_type: str = "service_unavailable") -> PdserveError:
    error = PdserveError(message)
    error.http_status, error.error_type = http_status, error_type
    return error


@dataclass
class Node:
    """One node as the router sees it. ``in_flight``: the router's own count of its rows there (a prefill node
    holds a row until the decode node has the KV, a decode node while its stream is open)."""

    url: str
    role: str               # "prefill" or "decode"
    healthy: bool = False   # answered /internal/status with healthy true at the last poll
    dead: bool = False      # no answer for actor_hang_timeout_s
    last_ok: float = 0.0    # time.monotonic() of the last answer (0 = never)
    last_error: str = ""
    engine_id: str = ""
    reported_active: int = 0
    kv_blocks_free: int = 0
    in_flight: int = 0
    mismatch_ticks: int = 0
    mismatches_total: int = 0
    cache_words: Any = None   # a prefill node's cached block keys at the last poll (sorted u8 array; None: none)
    block_tokens: int = 16    # its KV block size (the unit of its cache keys)
    drained: str = ""         # why the router drained it (actors/ejection.py reason); "" = serving

    @property
    def serving(self) -> bool:
        """It takes new requests: healthy at the last poll, not dead, not drained."""
        return self.healthy and not self.dead and not self.drained

    def view(self, now: float) -> dict[str, Any]:
        return {"url": self.url, "role": self.role, "healthy": self.healthy and not self.dead, "dead": self.dead,
                "engine_id": self.engine_id, "last_ok_age_s": round(now - self.last_ok, 3) if self.last_ok else None,
                "last_error": self.last_error, "in_flight": self.in_flight, "reported_active": self.reported_active,
                "kv_blocks_free": self.kv_blocks_free, "count_mismatches_total": self.mismatches_total,
                "drained": self.drained or None}


@dataclass
class InFlight:
    """One choice of a request on its way through two nodes: its flight (api/flight.py decides) and the I/O that
    carries it out."""

    handle: RequestHandle
    prefill: Node
    decode: Node
    flight: Flight = field(default_factory=Flight)
    prefill_task: asyncio.Task | None = None   # shared by the request's choices (one /internal/prefill call)
    decode_task: asyncio.Task | None = None
    siblings: list["InFlight"] = field(default_factory=list)   # every choice of the request, this one included

    @property
    def ended(self) -> bool:
        return self.flight.ended

    def dead(self) -> list[str]:
        """The roles of this flight's nodes marked dead (told nothing)."""
        return [n.role for n in (self.prefill, self.decode) if n.dead]


def cached_prefix_tokens(node: Node, prompt_ids: Sequence[int]) -> int:
    """The tokens of ``prompt_ids``' longest prefix ``node`` reported cached at its last poll, in whole blocks, at
    most ``(len - 1) // block_tokens`` of them (as api/admission.py ``PrefixLookup``)."""
    if node.cache_words is None or not len(node.cache_words):
        return 0
    bt = node.block_tokens
    usable = max(len(prompt_ids) - 1, 0) // bt * bt
    return leading_run(node.cache_words, block_keys(prompt_ids[:usable], bt)) * bt


def pick_node(nodes: list[Node], role: str, prompt_ids: Sequence[int] = (),
              queued_tokens: dict[str, int] | None = None, max_imbalance_tokens: int | None = None) -> Node:
    """The serving node of ``role`` (``Node.serving``) with the fewest of the router's requests in flight (then list
    order); for a prefill node first the longest cached prefix of ``prompt_ids`` (its last poll's report), among
    the nodes whose queued prompt tokens (``queued_tokens``: node url -> the router's prompts there not yet
    prefilled) exceed the least-queued one's by at most ``max_imbalance_tokens`` (None: no bound), as api/router.py
    ``pick_prefill`` within one node. A drained node serves again while no undrained one of its role does (a drain
    keeps work off a sick node while another can take it). Raises EngineOverloadedError when none is serving."""
    serving = [n for n in nodes if n.role == role and n.serving] or \
        [n for n in nodes if n.role == role and n.healthy and not n.dead]
    if not serving:
        raise EngineOverloadedError(f"no {role} node is serving (unreachable, dead, unhealthy or drained); retry")
    if role != "prefill" or len(serving) == 1:
        return min(serving, key=lambda n: n.in_flight)
    queued = queued_tokens or {}
    if max_imbalance_tokens is not None:
        least = min(queued.get(n.url, 0) for n in serving)
        serving = [n for n in serving if queued.get(n.url, 0) - least <= max_imbalance_tokens]
    return min(serving, key=lambda n: (-cached_prefix_tokens(n, prompt_ids), n.in_flight))


def read_cache_report(report: Any) -> tuple[Any, int]:
    """``(cache words, block tokens)`` from a node's ``/internal/status`` ``cache`` field (None: no cache
    reported). Raises ValueError for a malformed one."""
    if report is None:
        return None, 16
    if not isinstance(report, dict) or not isinstance(report.get("words"), str) or \
            not isinstance(report.get("block_tokens"), int) or report["block_tokens"] < 1:
        raise ValueError(f"a node's cache report wants {{'block_tokens': int > 0, 'words': str}}; got "
                         f"{str(report)[:100]}")
    return decode_words(report["words"]), report["block_tokens"]


class RouterClient:
    """What api/exchange.py's Exchange needs of an engine (``submit``, ``next_event``, ``finish``, ``finish_all``,
    ``stop_generation``, ``num_active``, ``config``), over prefill and decode nodes."""

    def __init__(self, config, prefill_urls: list[str], decode_urls: list[str], node_secret: str = ""):
        if not prefill_urls or not decode_urls:
            raise InvalidRequestError("the router needs at least one --prefill-node and one --decode-node")
        self.config = config
        self.policy = AdmissionPolicy(config.max_queued_requests, config.request_timeout_s)
        self.nodes = [Node(u.rstrip("/"), "prefill") for u in prefill_urls] + \
                     [Node(u.rstrip("/"), "decode") for u in decode_urls]
        self.handles: dict[tuple[int, int], RequestHandle] = {}
        self.flights: dict[tuple[int, int], InFlight] = {}
        self.headers = {"authorization": f"Bearer {node_secret}"} if node_secret else {}
        self._ids = itertools.count(1)
        self._poller: asyncio.Task | None = None
        self._messages: set[asyncio.Task] = set()   # transfer_done / abort calls in flight (_background)
        self.http = None
        self.ejection = Ejection([f"{n.role} node {n.url}" for n in self.nodes],
                                 {i: n.role for i, n in enumerate(self.nodes)}, config.eject_timeouts,
                                 config.eject_window_s) if config.eject_timeouts else None
        self.probes: dict[int, asyncio.Task] = {}   # node index -> its readmission probe running
        self.probe_due: dict[int, float] = {}       # node index -> time.monotonic() its next probe is due
        self._probe_ids = itertools.count(1)

    # ---- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        # HTTP/2 only (h2c prior knowledge on http://, ALPN h2 on https://): every call to a node is a stream on
        # one connection per node; trust_env=False: node traffic never goes through an HTTP(S)_PROXY (the TLS
        # context reads SSL_CERT_FILE itself)
        self.http = httpx.AsyncClient(limits=limits, headers=self.headers, timeout=httpx.Timeout(5.0),
                                      trust_env=False, http1=False, http2=True,
                                      verify=node_ssl_context(self.config))
        # node polls on connections of their own: a stream stalled on a frozen node must not delay the verdict
        self.poll_http = httpx.AsyncClient(headers=self.headers, trust_env=False,
                                           verify=node_ssl_context(self.config))
        await self.poll_nodes()
        self._poller = asyncio.create_task(self._poll_loop())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for task in self.probes.values():
            task.cancel()
        for flight in list(self.flights.values()):
            self._end(flight)
        if self.http is not None:
            await self.http.aclose()
            await self.poll_http.aclose()

    # ---- node health --------------------------------------------------------------------------------
    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.monitor_tick_s)
            try:
                await self.poll_nodes()
                self.start_probes()
            except Exception:   # the poller must outlive any one bad answer
                log.exception("node poll failed")

    async def poll_nodes(self) -> None:
        await asyncio.gather(*(self._poll(node) for node in self.nodes))

    async def _poll(self, node: Node) -> None:
        import httpx

        before = node.in_flight
        timeout_s = min(2.0, self.config.actor_hang_timeout_s / 2)
        try:   # wait_for: a hard bound on the whole call, whatever the client library waits on inside
            resp = await asyncio.wait_for(self.poll_http.get(node.url + "/internal/status", timeout=timeout_s),
                                          timeout_s + 0.5)
            report = resp.json()
            if resp.status_code != 200:
                raise ValueError(f"HTTP {resp.status_code}: {str(report)[:200]}")
        except (httpx.HTTPError, ValueError, asyncio.TimeoutError) as exc:
            # one slow or lost answer is not a verdict: the node keeps its last one until actor_hang_timeout_s;
            # a refused connection is (nothing listens there): no new request goes to it until it answers again
            node.last_error = f"{type(exc).__name__}: {exc}"[:300]
            if isinstance(exc, httpx.ConnectError):
                node.healthy = False
            silent_s = time.monotonic() - node.last_ok if node.last_ok else None
            if not node.dead and silent_s is not None and silent_s > self.config.actor_hang_timeout_s:
                self._node_died(node, silent_s)
            return
        if node.dead:
            log.warning("%s node %s answers again", node.role, node.url)
        was_healthy = node.healthy
        node.last_ok, node.dead, node.last_error = time.monotonic(), False, ""
        node.healthy = bool(report.get("healthy")) and report.get("role") == node.role
        if node.healthy != was_healthy:
            log.info("%s node %s is %s%s", node.role, node.url, "serving" if node.healthy else "not serving",
                     "" if node.healthy else f": {report.get('problems') or report.get('role')}")
        node.engine_id = str(report.get("engine_id", ""))
        node.reported_active = int(report.get("active", 0))
        node.kv_blocks_free = int(report.get("kv_blocks_free", 0))
        try:
            node.cache_words, node.block_tokens = read_cache_report(report.get("cache"))
        except ValueError as exc:   # a bad report loses the node its cache preference, nothing more
            node.cache_words = None
            log.warning("%s node %s: %s", node.role, node.url, exc)
        self._cross_check(node, before)

    def _cross_check(self, node: Node, before: int) -> None:
        """Router vs node request counts, as the monitor checks router vs table within a node: compared only when
        the router's count did not move during the poll, flagged after two disagreeing polls in a row."""
        if node.in_flight != before:
            return
        if node.reported_active == node.in_flight:
            node.mismatch_ticks = 0
            return
        node.mismatch_ticks += 1
        if node.mismatch_ticks == 2:
            node.mismatches_total += 1
            log.warning("%s node %s reports %d requests, the router holds %d there", node.role, node.url,
                        node.reported_active, node.in_flight)

    def _node_died(self, node: Node, silent_s: float) -> None:
        node.dead = True
        flights = [f for f in self.flights.values() if node in (f.prefill, f.decode) and not f.ended]
        log.error("%s node %s has not answered for %.1f s: marked dead, failing its %d requests", node.role,
                  node.url, silent_s, len(flights))
        for flight in flights:
            self._fail(flight, node_error(f"{node.role} node {node.url} stopped answering ({silent_s:.1f} s > "
                                          f"actor_hang_timeout_s={self.config.actor_hang_timeout_s}); retry"))

    # ---- ejection -----------------------------------------------------------------------------------
    def blame(self, node: Node, error: PdserveError, request_id: str) -> None:
        """A request failed on ``node`` with ``error``: a stage deadline's 504 counts one timeout of that stage for
        the node (``Ejection``), which may drain it."""
        stage = timed_out_stage(error.message) if getattr(error, "http_status", 0) == 504 else None
        if self.ejection is None or stage is None or request_id.startswith(PROBE_PREFIX):
            return
        index = self.nodes.index(node)
        serving = [i for i, n in enumerate(self.nodes) if n.serving]
        drain, note = self.ejection.record(index, _STAGE_STATE[stage], time.monotonic_ns(), request_id, serving)
        if note:
            log.warning("ejection: %s", note)
        if drain is not None:
            node.drained = drain.reason
            self.probe_due[index] = 0.0
            log.error("ejection: %s (the last: request %s); it gets no new request until a probe through it "
                      "answers (every eject_probe_interval_s=%g), its running requests go on", drain.reason,
                      request_id, self.config.eject_probe_interval_s)

    def start_probes(self) -> None:
        """A readmission probe for each drained node that has none running and is due (``probe``)."""
        now = time.monotonic()
        for index, node in enumerate(self.nodes):
            if node.drained and index not in self.probes and now >= self.probe_due.get(index, 0.0):
                task = asyncio.get_running_loop().create_task(self.probe(index), name=f"probe-{node.url}")
                self.probes[index] = task
                task.add_done_callback(lambda _, i=index: self.probes.pop(i, None))

    async def probe(self, index: int) -> bool:
        """Send one tiny request (``PROBE_PREFIX``) pinned to drained node ``index``, the other side on a serving
        node; an answer to its end readmits the node, else the next probe is due ``eject_probe_interval_s`` after
        this one ended. Returns whether it readmitted the node."""
        node = self.nodes[index]
        try:
            return await self._probe(node, index)
        finally:
            self.probe_due[index] = time.monotonic() + self.config.eject_probe_interval_s

    async def _probe(self, node: Node, index: int) -> bool:
        request = GenerationRequest("completion", f"{PROBE_PREFIX}{next(self._probe_ids)}", "", list(PROBE_PROMPT_IDS),
                                    Sampling(temperature=0.0, max_tokens=2, ignore_eos=True))
        try:
            handles = self.submit(request, pin=node)
        except PdserveError as exc:   # no node of the other side serving, or full: tried again later
            log.warning("ejection: no probe through %s now (%s); tried again in eject_probe_interval_s",
                        node.url, exc.message)
            return False
        handle, error = handles[0], None
        try:
            while error is None:
                event = await self.next_event(handle)
                if event[0] == "error":
                    error = event[1]
                elif event[0] == "token" and event[2] is not None:
                    break
        except PdserveError as exc:
            error = exc
        finally:
            self.finish(handle)   # its one choice (a drill's way out, api/drill.py; the exchange ends HTTP requests)
        if error is not None:
            log.warning("ejection: probe %s through %s failed (%s): it stays drained", request.request_id,
                        node.url, error.message)
            return False
        if self.ejection is not None:
            self.ejection.readmit(index)
        log.warning("ejection: %s node %s readmitted: probe %s through it answered (it was %s)", node.role,
                    node.url, request.request_id, node.drained)
        node.drained = ""
        return True

    # ---- admission ----------------------------------------------------------------------------------
    def num_active(self) -> int:
        return len(self.handles)

    def check_room(self, sequences: int) -> None:
        """Raises as :meth:`submit` would when ``sequences`` more do not fit beside those in flight."""
        self.policy.check_room(len(self.handles), sequences)

    def submit(self, request: GenerationRequest, timeout_s: float | None = None,
               pin: Node | None = None) -> list[RequestHandle]:
        """Route a request to a prefill and a decode node (one handle per choice) and start it; ``pin``: the node of
        its role to use, drained or not (a readmission probe), if it answers and is healthy. Raises
        EngineOverloadedError (no node of a role serving, or too many sequences in flight), InvalidRequestError
        (``n`` alone over max_queued_requests: api/admission.py ``AdmissionPolicy``)."""
        self.policy.check_room(len(self.handles), request.n)
        if pin is not None and not (pin.healthy and not pin.dead):
            raise EngineOverloadedError(f"{pin.role} node {pin.url} is not healthy; retry")
        prefill = pin if pin is not None and pin.role == "prefill" else \
            pick_node(self.nodes, "prefill", request.prompt_ids, self.queued_prompt_tokens(),
                      self.config.cache_routing_max_imbalance_tokens)
        decode = pin if pin is not None and pin.role == "decode" else pick_node(self.nodes, "decode")
        timeout_s = self.policy.timeout_s(request, timeout_s)
        request_id = next(self._ids)
        handles = []
        for index in range(request.n):
            handle = RequestHandle(request, request_id, index + 1, request.first_index + index,
                                   deadline_s=time.monotonic() + timeout_s)
            self.handles[handle.key] = handle
            self.flights[handle.key] = InFlight(handle, prefill, decode)
            prefill.in_flight += 1
            handles.append(handle)
        flights = [self.flights[h.key] for h in handles]
        task = asyncio.create_task(self._prefill(flights, timeout_s))
        for flight in flights:
            flight.prefill_task, flight.siblings = task, flights
        return handles

    def queued_prompt_tokens(self) -> dict[str, int]:
        """Prefill node url -> prompt tokens of the router's requests there whose prefill call has not answered
        (each request once, whatever its ``n``)."""
        queued: dict[str, int] = {}
        for flight in self.flights.values():
            task = flight.prefill_task
            if flight.siblings and flight is flight.siblings[0] and task is not None and not task.done():
                url = flight.prefill.url
                queued[url] = queued.get(url, 0) + len(flight.handle.request.prompt_ids)
        return queued

    async def next_event(self, handle: RequestHandle) -> tuple:
        return await wait_event(handle, self.config.request_timeout_s)

    # ---- one request's way through the nodes --------------------------------------------------------
    async def _call(self, node: Node, path: str, body: dict, timeout_s: float) -> dict:
        """POST ``body`` to ``node``; the answer's JSON. Raises PdserveError: the node's own error (its status),
        or 503 when it cannot be reached or times out."""
        import httpx

        try:
            resp = await asyncio.wait_for(self.http.post(node.url + path, content=orjson.dumps(body),
                                                         timeout=timeout_s,
                                                         headers={"content-type": "application/json",
                                                                  **INCOMING.get()}),
                                          timeout_s + 1.0)
        except (httpx.HTTPError, asyncio.TimeoutError) as exc:
            if isinstance(exc, httpx.ConnectError):   # nothing listens there: route elsewhere until it answers
                node.healthy = False
            raise node_error(f"{node.role} node {node.url}: {type(exc).__name__} on {path}: {exc}") from None
        return self._answer(node, path, resp.status_code, resp.content)

    def _answer(self, node: Node, path: str, status: int, content: bytes) -> dict:
        try:
            answer = orjson.loads(content)
        except orjson.JSONDecodeError:
            answer = None
        if status in (401, 403):   # the router's own configuration, never the client's fault
            raise node_error(f"{node.role} node {node.url} refused the router's node_secret on {path} (HTTP "
                             f"{status}); give the router and its nodes the same node_secret", 502, "bad_gateway")
        if status != 200 or not isinstance(answer, dict):
            error = (answer or {}).get("error") if isinstance(answer, dict) else None
            if isinstance(error, dict):
                raise node_error(f"{node.role} node: {error.get('message')}", status,
                                 str(error.get("type") or "service_unavailable"))
            raise node_error(f"{node.role} node {node.url} answered HTTP {status} on {path}", 502, "bad_gateway")
        return answer

    async def _prefill(self, flights: list[InFlight], timeout_s: float) -> None:
        first = flights[0]
        request = first.handle.request
        try:
            answer = await self._call(first.prefill, "/internal/prefill", {"request": request_wire(request)},
                                      timeout_s)
            rows, readies, peer = answer["rows"], answer["kv_ready"], answer["peer"]
        except PdserveError as exc:
            self.blame(first.prefill, exc, request.request_id)
            for flight in flights:
                self._fail(flight, exc)
            return
        for flight, row, ready in zip(flights, rows, readies):
            flight.handle.prompt_logprobs = answer.get("prompt_logprobs") or []
            # ended already (the client left or a node died while prefill ran): the flight aborts the row there
            self._carry(flight, flight.flight.prefilled(row, flight.dead()), ready=ready, peer=peer)

    async def _decode(self, flight: InFlight, ready: list, peer: str) -> None:
        import httpx

        handle, node = flight.handle, flight.decode
        body = {"request": request_wire(handle.request), "kv_ready": ready, "peer": peer,
                "timeout_s": max(handle.deadline_s - time.monotonic(), 0.001)}
        timeout = httpx.Timeout(5.0, read=max(handle.deadline_s - time.monotonic(), 0.0) + 5.0)
        try:
            async with self.http.stream("POST", node.url + "/internal/decode", content=orjson.dumps(body),
                                        timeout=timeout,
                                        headers={"content-type": "application/json", **INCOMING.get()}) as resp:
                if resp.status_code != 200:
                    self._answer(node, "/internal/decode", resp.status_code, await resp.aread())
                async for line in resp.aiter_lines():
                    if line and self._on_line(flight, orjson.loads(line)):
                        return
            raise node_error(f"decode node {node.url} closed the stream before the last token", 502, "bad_gateway")
        except PdserveError as exc:
            self._fail(flight, exc)
        except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
            if isinstance(exc, httpx.ConnectError):
                node.healthy = False
            self._fail(flight, node_error(f"decode node {node.url}: {type(exc).__name__}: {exc}"))

    def _on_line(self, flight: InFlight, line: dict) -> bool:
        """One line of a decode stream; True when the sequence is over (a finish reason or an error)."""
        handle = flight.handle
        if "row" in line:
            self._carry(flight, flight.flight.opened(line["row"]))
            return False
        if line.get("transfer_done"):
            self._carry(flight, flight.flight.transfer_done())
            return False
        if "error" in line:
            error = line["error"]
            handle.ended = True
            exc = node_error(error.get("message", "decode node error"), int(error.get("status", 502)),
                             str(error.get("type", "bad_gateway")))
            self.blame(flight.decode, exc, handle.request.request_id)
            handle.events.put_nowait(("error", exc))
            return True
        token, reason, logprobs = line["token"]
        if line.get("timings"):
            handle.timings = line["timings"]
        handle.prefilled = True
        handle.ended = handle.ended or reason is not None
        handle.events.put_nowait(("token", token, reason, logprobs))
        if reason is not None:   # the decode node ended the row itself
            self._carry(flight, flight.flight.last_token())
        return reason is not None

    async def _tell(self, node: Node, path: str, body: dict, request_id: str) -> None:
        try:
            await self._call(node, path, body, timeout_s=min(5.0, self.config.actor_hang_timeout_s))
        except PdserveError as exc:   # the node's own deadlines free the row: a lost message costs time, not KV
            log.warning("request %s: %s on %s failed: %s", request_id, path, node.url, exc.message)

    def _fail(self, flight: InFlight, error: PdserveError) -> None:
        self._carry(flight, flight.flight.fail(error, flight.dead()))

    def _end(self, flight: InFlight) -> None:
        self._carry(flight, flight.flight.end(flight.dead()))

    def _carry(self, flight: InFlight, effects: list[Effect], ready: list | None = None, peer: str = "") -> None:
        """Carry out a flight's effects (api/flight.py ``Effect``): counts, the decode stream, messages to the
        nodes (in the background: a finished request must not cancel them), the client's error."""
        current = asyncio.current_task()
        request_id = flight.handle.request.request_id
        for effect in effects:
            node = flight.prefill if effect.node == "prefill" else flight.decode
            if effect.action == "in_flight":
                node.in_flight += effect.value
            elif effect.action == "open_stream":
                flight.decode_task = asyncio.create_task(self._decode(flight, ready, peer))
            elif effect.action in ("close_stream", "cancel_prefill"):   # closing a stream aborts the row there too
                task = flight.decode_task if effect.action == "close_stream" else flight.prefill_task
                if effect.action == "cancel_prefill" and not all(f.ended for f in flight.siblings):
                    continue   # the call is shared: another choice still waits on it
                if task is not None and task is not current and not task.done():
                    task.cancel()
            elif effect.action == "transfer_done":
                self._background(self._tell(node, "/internal/transfer_done",
                                            {"slot": effect.row[0], "generation": effect.row[1]}, request_id))
            elif effect.action == "abort":
                self._background(self._tell(node, "/internal/abort", {"rows": [list(effect.row)]}, request_id))
            elif effect.action == "error":
                flight.handle.ended = True
                flight.handle.events.put_nowait(("error", effect.value))
            else:
                raise ValueError(f"unknown flight effect {effect}")

    def _background(self, coro) -> None:
        """Run a message to a node to its end (its own timeout bounds it), whatever happens to the request that
        sent it: a finished request must not cancel the transfer_done that frees the prefill node's blocks."""
        task = asyncio.get_running_loop().create_task(coro)
        self._messages.add(task)   # a strong reference until it is done (the loop keeps only weak ones)
        task.add_done_callback(self._messages.discard)

    # ---- completion ---------------------------------------------------------------------------------
    def stop_generation(self, handle: RequestHandle) -> None:
        """A stop string matched: end the sequence (the decode node aborts its row when the stream closes)."""
        flight = self.flights.get(handle.key)
        if flight is not None:
            self._end(flight)

    def finish(self, handle: RequestHandle) -> None:
        if self.handles.pop(handle.key, None) is None:
            return
        flight = self.flights.pop(handle.key, None)
        if flight is not None:
            self._end(flight)

    def finish_all(self, handles: list[RequestHandle]) -> None:
        for handle in handles:
            self.finish(handle)

    # ---- views --------------------------------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        """The router's part of tools/inspect's ``--url`` document: its nodes and its requests in flight."""
        now = time.monotonic()
        requests = [{"request_id": f.handle.request.request_id, "choice": f.handle.index,
                     "prefill_node": f.prefill.url, "decode_node": f.decode.url, "stage": f.flight.stage.value,
                     "age_s": round(now - f.handle.admitted_ns / 1e9, 3)}
                    for f in self.flights.values() if not f.ended]
        return {"requests": requests, "nodes": [n.view(now) for n in self.nodes]}
