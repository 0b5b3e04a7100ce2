"""api/http_edges.py's guarded Hypercorn and h2 wrappers (their effect on the wire is tested end to end in
tests/e2e/test_openai_api.py: idle GOAWAY over h2c and TLS, the staged HTTP/1.1 close, REFUSED_STREAM; and in
tests/e2e/test_hostile.py: the close on a client's FIN, HTTP/2 rapid reset)."""
from __future__ import annotations

import pytest


def test_idle_close_wrapper_installs_once_around_hypercorns_own_close():
    from hypercorn.asyncio.tcp_server import TCPServer

    from api.http_edges import install_idle_close

    assert install_idle_close() is True
    wrapper = TCPServer._initiate_server_close
    assert install_idle_close() is True
    assert TCPServer._initiate_server_close is wrapper, "a second install must not wrap the wrapper"
    original = wrapper.__wrapped__
    assert not hasattr(original, "__wrapped__") and original.__qualname__ == "TCPServer._initiate_server_close"


def test_refused_streams_wrapper_installs_once_around_h2s_own_headers_handling():
    from h2.connection import H2Connection

    from api.http_edges import install_refused_streams

    assert install_refused_streams() is True
    wrapper = H2Connection._receive_headers_frame
    assert install_refused_streams() is True
    assert H2Connection._receive_headers_frame is wrapper
    assert wrapper.__wrapped__.__qualname__ == "H2Connection._receive_headers_frame"


@pytest.mark.parametrize("timeout_s, header", [(5.0, b"timeout=5"), (1.0, b"timeout=1"), (2.9, b"timeout=2"),
                                               (0.5, None)])
def test_keep_alive_header_never_promises_more_than_the_server_keeps(timeout_s, header):
    from api.http_edges import keep_alive_config, keep_alive_header_value

    assert keep_alive_header_value(timeout_s) == header
    config = keep_alive_config(timeout_s)
    assert config.keep_alive_timeout == timeout_s
    assert (dict(config.response_headers("h11")).get(b"keep-alive")) == header
    assert b"keep-alive" not in dict(config.response_headers("h2")), "connection-specific: forbidden in HTTP/2"


def test_a_stream_over_the_limit_is_refused_alone_and_its_header_block_still_decoded():
    """An in-memory h2 client and server (the server set up as Hypercorn sets it up, limit 2 here): three HEADERS
    in one flight; the third is refused with RST_STREAM(REFUSED_STREAM), the first two arrive, no GOAWAY; a later
    request that refers to the refused block's HPACK entry is decoded right."""
    import h2.config
    import h2.connection
    import h2.errors
    import h2.events
    import h2.settings

    from api.http_edges import install_refused_streams

    assert install_refused_streams()
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    server.local_settings = h2.settings.Settings(
        client=False, initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 2})
    server.initiate_connection()
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()

    def request(stream_id: int, rid: str) -> None:
        client.send_headers(stream_id, [(":method", "GET"), (":path", "/"), (":scheme", "http"),
                                        (":authority", "x"), ("x-request-id", rid)], end_stream=True)

    for stream_id in (1, 3, 5):
        request(stream_id, f"id-{stream_id}")
    events = server.receive_data(client.data_to_send())
    received = [e.stream_id for e in events if isinstance(e, h2.events.RequestReceived)]
    assert received == [1, 3]
    answer = client.receive_data(server.data_to_send())
    resets = [(e.stream_id, e.error_code) for e in answer if isinstance(e, h2.events.StreamReset)]
    assert resets == [(5, h2.errors.ErrorCodes.REFUSED_STREAM)]
    assert not [e for e in answer if isinstance(e, h2.events.ConnectionTerminated)]
    server.send_headers(1, [(":status", "200")], end_stream=True)
    client.receive_data(server.data_to_send())
    request(7, "id-5")   # sent as an index into the entry the refused block added
    events = server.receive_data(client.data_to_send())
    headers = next(dict(e.headers) for e in events if isinstance(e, h2.events.RequestReceived))
    assert headers[b"x-request-id"] == b"id-5"


def test_the_h2_idle_start_patch_is_in_place_after_the_idle_close_install():
    """The one patch that finds nothing to wrap without a warning (H2Protocol.initiate): an upgrade that moves it
    fails here rather than leaving a preface-only h2c connection open forever."""
    from hypercorn.protocol.h2 import H2Protocol

    from api import http_edges

    assert http_edges.install_idle_close() is True
    assert getattr(H2Protocol.initiate, http_edges._PATCH_MARK, False)
    assert H2Protocol.initiate.__wrapped__.__qualname__ == "H2Protocol.initiate"


def test_the_eof_close_patches_are_in_place_after_the_idle_close_install():
    """Hypercorn's read loop and keep-alive timer, wrapped so a client's FIN on an idle connection closes it at once:
    an upgrade that renames them fails here instead of leaving such sockets in CLOSE-WAIT for keep_alive_timeout."""
    from hypercorn.asyncio.tcp_server import TCPServer

    from api import http_edges

    assert http_edges.install_idle_close() is True
    for name in ("_read_data", "_idle_timeout"):
        wrapper = getattr(TCPServer, name)
        assert getattr(wrapper, http_edges._PATCH_MARK, False), name
        assert wrapper.__wrapped__.__qualname__ == f"TCPServer.{name}"


def test_reset_streams_wrappers_install_once_around_hypercorns_own_handlers():
    from hypercorn.protocol.h2 import H2Protocol
    from hypercorn.protocol.http_stream import HTTPStream

    from api.http_edges import install_reset_streams

    assert install_reset_streams() is True
    handle, handle_events = HTTPStream.handle, H2Protocol._handle_events
    assert install_reset_streams() is True
    assert (HTTPStream.handle, H2Protocol._handle_events) == (handle, handle_events)
    assert handle.__wrapped__.__qualname__ == "HTTPStream.handle"


def test_the_grammar_view_is_built_once_every_engine_actor_reads_ready(engine_id):
    """The API's tokenizer view waits for the engine (its CPU would compete with the actors' start-up): a tick
    while an engine actor still starts builds nothing, the first tick with every engine actor READY builds it in
    the background."""
    import threading

    from actors.topology import topology
    from api.server import grammar_compiler
    from gpu.tokenizer import Tokenizer
    from ipc import naming
    from ipc.actor_table import ActorStatus, ActorTable
    from pdserve.config import load_config
    from tests.conftest import wait_until

    topo = topology(load_config({}, {}).config)
    actors = ActorTable.create(naming.segment_name(engine_id, "actors"), len(topo.names))
    try:
        grammars, tick = grammar_compiler(Tokenizer.load(None), actors, topo)
        for i in (*topo.prefill, *topo.decode, topo.api):
            actors.register(i, topo.names[i], "cpu")
            actors.set_status(i, ActorStatus.STARTING)
        actors.set_status(topo.prefill[0], ActorStatus.READY)
        tick()
        assert not any(t.name == "grammar-warm-up" for t in threading.enumerate())
        assert grammars._ll is None   # decode0 still starts: nothing built
        actors.set_status(topo.decode[0], ActorStatus.READY)
        tick()
        wait_until(lambda: grammars._ll is not None, 60, 0.05, "the tokenizer view built in the background")
        assert grammars.vocab_size == Tokenizer.load(None).vocab_size
    finally:
        actors.close()
        actors.unlink()
