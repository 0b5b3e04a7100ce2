"""Message frames and addresses (actors/messages.py, actors/topology.py, actors/ports.py QueueOutbox): plain code."""
from __future__ import annotations

import logging

import pytest

from actors.messages import WIRE_VERSION, KVReady, PrefillRequest, Sampling, TransferDone, from_wire, parse_frames, \
    to_wire
from actors.ports import QueueOutbox
from actors.topology import LOCAL_DECODE, LOCAL_PREFILL, NO_ACTOR, REMOTE, REMOTE_ACTOR, Topology, peer_address


def test_a_frame_carries_its_wire_version_and_addresses_and_round_trips():
    ready = KVReady(3, 1, "r", [4, 7], 20, 42, Sampling(max_tokens=8, stop_token_ids=(2,)), prefill_actor="prefill1",
                    peer="{}", prompt_row=[3, 1])
    frame = to_wire(ready)
    assert frame[:2] == ["kv_ready", WIRE_VERSION] and "prefill1" in frame
    assert from_wire(frame) == ready
    request = PrefillRequest(1, 2, "q", [1, 2], Sampling(), decode_actor=REMOTE)
    assert from_wire(to_wire(request)) == request
    assert (PrefillRequest(1, 2, "q", [1], Sampling()).decode_actor, ready.__class__(
        1, 1, "x", [], 1, 1, Sampling()).prefill_actor) == (LOCAL_DECODE, LOCAL_PREFILL)


def test_a_frame_of_another_wire_version_is_refused_and_dropped(caplog):
    old = ["transfer_done", 5, 9]   # version 1: no version field
    other = ["transfer_done", WIRE_VERSION + 1, 5, 9]
    for frame in (old, other):
        with pytest.raises(ValueError, match="wire version"):
            from_wire(frame)
    with caplog.at_level(logging.ERROR):
        assert parse_frames([old, to_wire(TransferDone(5, 9)), other], logging.getLogger("t")) == [TransferDone(5, 9)]
    assert caplog.text.count("wire version") == 2


def test_an_actor_index_has_one_address_and_sentinels_name_none_or_the_other_node():
    topo = Topology(2, 2)
    assert [topo.address(i) for i in range(topo.monitor + 1)] == ["prefill0", "prefill1", "decode0", "decode1",
                                                                  "api", "monitor"]
    assert topo.address(REMOTE_ACTOR) == REMOTE and peer_address(3) == "peer:3"
    for index in (NO_ACTOR, topo.monitor + 1):
        with pytest.raises(ValueError, match="names no actor"):
            topo.address(index)


class Inbox:
    def __init__(self):
        self.frames = []

    def put(self, frame, timeout_s):
        self.frames.append(frame)


class Core:
    def __init__(self):
        self.messages = []

    def on_message(self, message):
        self.messages.append(message)


def test_the_outbox_resolves_an_address_to_a_queue_or_a_local_core_and_refuses_an_unknown_one():
    api, prefill0 = Inbox(), Inbox()
    outbox = QueueOutbox({"api": api, "prefill0": prefill0}, put_timeout_s=1.0)
    local = Core()
    outbox.add_local(LOCAL_PREFILL, local)
    outbox.add_queue(peer_address(0), api)   # a remote prefill pool's TransferDone: through the API
    outbox.send("prefill0", TransferDone(1, 1))
    outbox.send(peer_address(0), TransferDone(2, 1))
    outbox.send(LOCAL_PREFILL, TransferDone(3, 1))
    assert [from_wire(f) for f in prefill0.frames] == [TransferDone(1, 1)]
    assert [from_wire(f) for f in api.frames] == [TransferDone(2, 1)]
    assert local.messages == [TransferDone(3, 1)]
    with pytest.raises(KeyError):
        outbox.send("decode5", TransferDone(4, 1))
