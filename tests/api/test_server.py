"""api/server.py's Hypercorn wrapper for GOAWAY on idle HTTP/2 connections (its effect on the wire is tested in
tests/e2e/test_openai_api.py, over h2c and TLS)."""
from __future__ import annotations


def test_idle_goaway_wrapper_installs_once_around_hypercorns_own_close():
    from hypercorn.asyncio.tcp_server import TCPServer

    from api.server import install_idle_goaway

    assert install_idle_goaway() is True
    wrapper = TCPServer._initiate_server_close
    assert install_idle_goaway() is True
    assert TCPServer._initiate_server_close is wrapper, "a second install must not wrap the wrapper"
    original = wrapper.__wrapped__
    assert not hasattr(original, "__wrapped__") and original.__qualname__ == "TCPServer._initiate_server_close"
