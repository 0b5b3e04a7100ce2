"""The router's flight (api/flight.py) as plain code: what each ending owes which node, in each stage, for a client
that leaves, a node that dies and a transfer_done before and after an abort (the HTTP: tests/multinode)."""
from __future__ import annotations

import pytest

from api.flight import RULE, RULES, Effect, Flight, Stage

PREFILL_ROW, DECODE_ROW = (3, 1), (8, 2)
ERROR = object()


def counts(effects: list[Effect]) -> dict[str, int]:
    out = {"prefill": 0, "decode": 0}
    for e in effects:
        if e.action == "in_flight":
            out[e.node] += e.value
    return out


def messages(effects: list[Effect]) -> list[Effect]:
    return [e for e in effects if e.action != "in_flight"]


def in_prefill() -> tuple[Flight, list[Effect]]:
    return Flight(), []


def in_decode() -> tuple[Flight, list[Effect]]:
    flight = Flight()
    effects = flight.prefilled(PREFILL_ROW) + flight.opened(DECODE_ROW)
    return flight, effects


def after_transfer_done() -> tuple[Flight, list[Effect]]:
    flight, effects = in_decode()
    return flight, effects + flight.transfer_done()


def after_last_token() -> tuple[Flight, list[Effect]]:
    flight, effects = after_transfer_done()
    return flight, effects + flight.last_token()


def test_a_flight_through_both_nodes_counts_each_once_and_tells_prefill_transfer_done():
    flight, effects = after_last_token()
    assert flight.stage is Stage.DECODE
    assert messages(effects) == [Effect("open_stream", "decode"), Effect("transfer_done", "prefill", PREFILL_ROW)]
    assert counts(effects) == {"prefill": -1, "decode": 1}   # prefill's +1 is counted at admission
    end = flight.end()
    assert flight.ended and messages(end) == [Effect("close_stream", "decode")]
    assert counts(effects + end) == {"prefill": -1, "decode": 0}
    assert flight.end() == []   # a second ending owes nothing


# what a client that leaves (or a stop string) owes in each stage, after the stage's own effects
CLIENT_GONE = [
    (in_prefill, [Effect("cancel_prefill", "prefill")]),
    (in_decode, [Effect("abort", "decode", DECODE_ROW), Effect("close_stream", "decode"),
                 Effect("abort", "prefill", PREFILL_ROW)]),
    (after_transfer_done, [Effect("abort", "decode", DECODE_ROW), Effect("close_stream", "decode")]),
    (after_last_token, [Effect("close_stream", "decode")]),
]


@pytest.mark.parametrize("stage, owed", CLIENT_GONE, ids=[c[0].__name__ for c in CLIENT_GONE])
def test_a_client_gone_in_each_stage_aborts_exactly_the_rows_still_held(stage, owed):
    flight, before = stage()
    end = flight.end()
    assert messages(end) == owed and flight.ended
    assert counts(before + end) == {"prefill": -1, "decode": 0}   # out of both counts, once


def test_a_client_gone_during_prefill_aborts_the_rows_when_the_answer_arrives():
    flight = Flight()
    flight.end()
    assert flight.prefilled(PREFILL_ROW) == [Effect("abort", "prefill", PREFILL_ROW)]
    assert flight.stage is Stage.DONE and flight.transfer_done() == [] and flight.opened(DECODE_ROW) == []


NODE_DIES = [
    (in_prefill, "prefill", [Effect("cancel_prefill", "prefill")]),
    (in_decode, "prefill", [Effect("abort", "decode", DECODE_ROW), Effect("close_stream", "decode")]),
    (in_decode, "decode", [Effect("close_stream", "decode"), Effect("abort", "prefill", PREFILL_ROW)]),
    (after_transfer_done, "decode", [Effect("close_stream", "decode")]),
    (after_transfer_done, "prefill", [Effect("abort", "decode", DECODE_ROW), Effect("close_stream", "decode")]),
]


@pytest.mark.parametrize("stage, dead, owed", NODE_DIES, ids=[f"{c[0].__name__}-{c[1]}" for c in NODE_DIES])
def test_a_node_death_in_each_stage_fails_the_client_and_tells_only_the_live_node(stage, dead, owed):
    flight, before = stage()
    failed = flight.fail(ERROR, dead=[dead])
    assert messages(failed) == [Effect("error", value=ERROR)] + owed
    assert all(e.node != dead for e in failed if e.action in ("abort", "transfer_done"))
    assert counts(before + failed) == {"prefill": -1, "decode": 0}
    assert flight.fail(ERROR, dead=[dead]) == []   # an ended flight tells the client nothing more


def test_a_prefill_node_dead_before_a_late_answer_is_not_told_to_abort():
    flight = Flight()
    flight.fail(ERROR, dead=["prefill"])
    assert flight.prefilled(PREFILL_ROW, dead=["prefill"]) == []


def test_transfer_done_before_an_abort_frees_prefill_once_and_the_abort_goes_to_decode_only():
    flight, _ = in_decode()
    assert messages(flight.transfer_done()) == [Effect("transfer_done", "prefill", PREFILL_ROW)]
    end = flight.end()
    assert [e for e in end if e.node == "prefill" and e.action != "in_flight"] == []
    assert Effect("abort", "decode", DECODE_ROW) in end


def test_transfer_done_after_an_abort_owes_nothing():
    flight, _ = in_decode()
    end = flight.end()
    assert Effect("abort", "prefill", PREFILL_ROW) in end
    assert flight.transfer_done() == [] and flight.last_token() == []


def test_done_takes_every_event_decode_all_but_a_second_answer_and_a_stream_line_before_prefill_is_a_bug():
    events = {r.event for r in RULES}
    assert {event for (s, event) in RULE if s is Stage.DONE} == events
    assert {event for (s, event) in RULE if s is Stage.DECODE} == events - {"prefilled"}
    assert RULE[(Stage.PREFILL, "end")].next is Stage.DONE and RULE[(Stage.DECODE, "end")].next is Stage.DONE
    with pytest.raises(ValueError, match="no rule"):
        Flight().transfer_done()
