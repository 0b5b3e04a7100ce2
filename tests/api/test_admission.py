"""The API's admission core (api/admission.py) over in-memory ports (tests/actors/fakes.py): every admission,
routing, reservation, rollback and release rule without a process. Each case checks the rows, the blocks
reserved and the messages sent."""
from __future__ import annotations

import dataclasses

import pytest

from actors.messages import KVReady, PrefillRequest, Sampling, TransferDone
from actors.topology import LOCAL_DECODE, NO_ACTOR, REMOTE, REMOTE_ACTOR, Topology
from api.admission import Admission, AdmissionPolicy
from api.protocol import GenerationRequest
from ipc.actor_table import ActorHealth, ActorStatus
from ipc.lifecycle import RequestState as S
from pdserve.config import EngineConfig
from pdserve.errors import EngineOverloadedError, InvalidRequestError, MessageTooLargeError, QueueFullError
from pdserve.kv_budget import blocks_for
from tests.actors.fakes import FakeActors, FakeClock, FakeTable, Outbox

API = 9
MAX_QUEUED = 4
TIMEOUT_S = 30.0


class Engine:
    """One admission core with its fakes: ``prefill`` / ``decode`` actor indices (colocated: no prefill)."""

    def __init__(self, role: str = "both", prefill=(0, 1), decode=(2, 3), num_rows: int = 64,
                 kv_blocks_free: int = 100, summaries=None, max_imbalance_tokens: int = 2048):
        self.clock = FakeClock()
        self.table = FakeTable(self.clock, num_rows=num_rows)
        self.outbox = Outbox()
        names = [f"prefill{i}" for i in range(len(prefill))] + [f"decode{j}" for j in range(len(decode))]
        self.actors = FakeActors(names, kv_blocks_free)
        self.draining = False
        self.config = EngineConfig(role=role, max_queued_requests=MAX_QUEUED, request_timeout_s=TIMEOUT_S,
                                   kv_block_tokens=16, cache_routing_max_imbalance_tokens=max_imbalance_tokens)
        self.core = Admission(self.config, self.table, self.outbox, self.actors, self.clock, lambda: self.draining,
                              owner=API, topology=Topology(len(prefill), len(decode)), summaries=summaries)

    def live(self) -> dict[int, dict]:
        return dict(self.table.rows)


def request(request_id: str = "r", prompt_tokens: int = 20, max_tokens: int = 12, n: int = 1,
            timeout_s: float | None = None) -> GenerationRequest:
    return GenerationRequest("completion", request_id, "m", list(range(1, prompt_tokens + 1)),
                             Sampling(max_tokens=max_tokens), n=n, timeout_s=timeout_s)


def kv_ready(peer: str = '{"pool": 1}', num_tokens: int = 40, max_tokens: int = 24) -> KVReady:
    return KVReady(5, 7, "r", [1, 2, 3], num_tokens, 11, Sampling(max_tokens=max_tokens), peer=peer,
                   prefill_actor=0)


def assert_nothing_held(engine: Engine) -> None:
    assert engine.table.rows == {} and engine.core.handles == {} and engine.outbox.sent == []
    assert set(engine.actors.routed.values()) <= {0}


def test_an_accepted_request_has_one_queued_row_per_choice_and_one_prefill_request():
    engine = Engine()
    handles = engine.core.admit(request(n=3, prompt_tokens=20, max_tokens=13))
    assert [h.index for h in handles] == [0, 1, 2]
    rows = [engine.table.rows[h.slot] for h in handles]
    assert all(r["state"] == S.QUEUED and r["owner"] == API for r in rows)
    assert all(r["prefill_actor"] == 0 and r["decode_actor"] == 2 for r in rows)
    assert all(r["deadline_ns"] == engine.clock() + int(TIMEOUT_S * 1e9) for r in rows)
    assert all(h.reserve_blocks == 3 for h in handles)           # ceil((20 + 13) / 16)
    (dest, message), = engine.outbox.sent
    assert dest == "prefill0" and isinstance(message, PrefillRequest)
    assert (message.slot, message.generation) == handles[0].key and message.decode_actor == "decode0"
    assert message.children == [list(h.key) for h in handles[1:]]
    assert engine.actors.routed == {0: 3, 1: 0, 2: 3, 3: 0}


def test_blocks_for_is_prompt_plus_max_tokens_rounded_up_to_blocks():
    assert [blocks_for(p, m, 16) for p, m in ((0, 1), (16, 0), (16, 1), (20, 13), (1, 31))] == [1, 1, 2, 3, 2]
    with pytest.raises(ValueError):
        blocks_for(1, 1, 0)


def test_the_deadline_is_the_requests_own_capped_at_request_timeout_s():
    engine = Engine()
    short, = engine.core.admit(request("a", timeout_s=2.0))
    long, = engine.core.admit(request("b", timeout_s=1000.0))
    assert engine.table.rows[short.slot]["deadline_ns"] == engine.clock() + 2_000_000_000
    assert engine.table.rows[long.slot]["deadline_ns"] == engine.clock() + int(TIMEOUT_S * 1e9)
    assert long.deadline_s == pytest.approx(engine.clock() / 1e9 + TIMEOUT_S)
    assert AdmissionPolicy(4, 30.0).timeout_s(request(timeout_s=None), None) == 30.0


def test_n_over_the_limit_is_a_400_and_in_flight_plus_n_over_it_a_503():
    engine = Engine()
    with pytest.raises(InvalidRequestError) as exc:
        engine.core.admit(request(n=MAX_QUEUED + 1))
    assert exc.value.param == "n"
    assert_nothing_held(engine)
    engine.core.admit(request("a", n=3))
    engine.outbox.sent.clear()
    with pytest.raises(EngineOverloadedError, match="max_queued_requests"):
        engine.core.admit(request("b", n=2))
    assert len(engine.table.rows) == 3 and len(engine.core.handles) == 3 and engine.outbox.sent == []


def test_a_watchdog_drill_in_flight_takes_no_room_from_clients():
    """api/drill.py runs one drill at a time, only while idle; even so its row never counts against
    max_queued_requests, so a burst arriving during a drill is admitted as without it."""
    engine = Engine()
    drill = engine.core.admit(request("drill-queued-1"))
    engine.core.admit(request("a", n=MAX_QUEUED))
    assert len(engine.core.handles) == MAX_QUEUED + 1
    with pytest.raises(EngineOverloadedError, match="4 sequences in flight"):
        engine.core.check_room(1)
    engine.core.release(drill[0])
    assert engine.core.drills == 0 and len(engine.core.handles) == MAX_QUEUED


def _client(engine: Engine):
    """api/app.py's view of an EngineClient over the core: what submit_all calls."""
    from types import SimpleNamespace

    return SimpleNamespace(submit=engine.core.admit, finish_all=engine.core.release_all,
                           check_room=engine.core.check_room)


def test_a_list_of_prompts_is_admitted_whole_with_choice_indices_after_the_earlier_prompts_or_not_at_all():
    """api/app.py's submit_all over the core: one PrefillRequest per prompt, choices indexed k * n + i; a refusal
    of a later prompt (here a full state table) aborts and releases the rows of those admitted before it."""
    from api.exchange import submit_all

    engine = Engine(num_rows=MAX_QUEUED)
    client = _client(engine)
    batch = [request("b", n=2), dataclasses.replace(request("b", n=2), first_index=2)]
    handles = submit_all(client, batch)
    assert [h.index for h in handles] == [0, 1, 2, 3] and len(engine.outbox.sent) == 2
    engine.core.release_all(handles)
    engine.table.num_rows = MAX_QUEUED - 1   # a row held elsewhere: the first prompt's 2 rows fit, the second's not
    with pytest.raises(EngineOverloadedError):
        submit_all(client, batch)
    assert engine.core.handles == {} and engine.table.rows == {}
    # the first prompt's 2 rows aborted (in the table) and freed, and the one row the second opened before the
    # table was full; the first prompt's PrefillRequest was sent, the second's never
    assert len(engine.table.released) == 4 + 2 + 1 and len(engine.outbox.sent) == 2 + 1


def test_a_list_of_prompts_over_the_in_flight_limit_is_refused_whole_before_any_is_admitted():
    """Beside one sequence in flight, a list of two prompts of n=2 (4 sequences, limit 4): one 503 saying 1 in
    flight and 4 asked for, no row opened and nothing sent (admitted one by one, its second prompt's 503 said 3 in
    flight and 2 asked for, and the first prompt went to a prefill actor only to be aborted)."""
    from api.exchange import submit_all

    engine = Engine()
    held, = engine.core.admit(request("x"))
    batch = [request("b", n=2), dataclasses.replace(request("b", n=2), first_index=2)]
    with pytest.raises(EngineOverloadedError, match="1 sequences in flight, 4 more asked for"):
        submit_all(_client(engine), batch)
    assert list(engine.core.handles) == [held.key] and list(engine.table.rows) == [held.slot]
    assert engine.table.released == [] and len(engine.outbox.sent) == 1


def test_a_reservation_not_yet_made_counts_against_its_decode_pool_until_the_first_token():
    engine = Engine(kv_blocks_free=10)
    engine.actors.table[3]["kv_blocks_free"] = 8
    first, = engine.core.admit(request("a", prompt_tokens=40, max_tokens=20))   # 4 blocks: decode 2 (10 free)
    assert first.decode_actor == 2 and first.reserve_blocks == 4
    assert [load.kv_blocks_free for load in engine.core.actor_loads()[1]] == [6, 8]
    second, = engine.core.admit(request("b", prompt_tokens=40, max_tokens=20))  # 6 < 8 free: decode 3
    assert second.decode_actor == 3
    assert engine.core.actor_loads()[0][0].queued_prompt_tokens == 40   # both prompts: prefill 0 then 1
    first.prefilled = True   # the decode actor reserved them: the table's count has them now
    assert [load.kv_blocks_free for load in engine.core.actor_loads()[1]] == [10, 4]


@pytest.fixture
def summaries(engine_id):
    """The prefill actors' cache summaries (real shm, 2 regions of 64 slots); unlinked with the test's engine id."""
    from ipc.cache_summary import CacheSummary
    from ipc.naming import segment_name

    summary = CacheSummary.create(segment_name(engine_id, "cachesum"), num_actors=2, slots=64)
    try:
        yield summary
    finally:
        summary.close()


def cache_on(summaries, index: int, prompt_ids: list[int], pid: int = 4242) -> None:
    """Prefill actor ``index`` (process ``pid``) caches every full block of ``prompt_ids``, as its PrefixCache
    listener would publish it."""
    from actors.prefix_cache import block_keys

    writer = summaries.writer(index)
    writer.clear(pid)
    for block, key in enumerate(block_keys(prompt_ids, 16)):
        writer.cached(block, key)


def test_a_prompt_goes_to_the_prefill_actor_caching_its_prefix_until_that_ones_queue_is_past_the_bound(summaries):
    """Load alone sends the first prompt to prefill 0. Prefill 1's summary lists the prompt's 2 full blocks: it
    takes the prompts while its queue is within 64 tokens of prefill 0's; the third (80 queued there, 0 on
    prefill 0) goes to prefill 0. A prompt with another first block has no cached prefix: load decides."""
    engine = Engine(summaries=summaries, max_imbalance_tokens=64)
    engine.actors.table[1]["actor_pid"] = 4242
    cache_on(summaries, 1, list(range(1, 41)))
    chosen = [engine.core.admit(request(f"r{i}", prompt_tokens=40))[0].prefill_actor for i in range(3)]
    assert chosen == [1, 1, 0]
    other = GenerationRequest("completion", "x", "m", [7] * 40, Sampling(max_tokens=4))
    assert engine.core.admit(other)[0].prefill_actor == 0   # 40 queued on 0, 80 on 1


def test_a_summary_from_another_process_than_the_actor_rows_is_no_hit(summaries):
    """The actor row names process 999 (the actor restarted): the region its predecessor 4242 wrote counts
    nothing, and load decides."""
    engine = Engine(summaries=summaries)
    engine.actors.table[1]["actor_pid"] = 999
    cache_on(summaries, 1, list(range(1, 41)), pid=4242)
    assert engine.core.admit(request("r", prompt_tokens=40))[0].prefill_actor == 0


def test_a_prompts_last_token_is_never_counted_cached(summaries):
    """Prefill 0 caches 3 blocks; a prompt of exactly 2 blocks of them counts 1 (the actor reuses at most
    (len - 1) // 16 blocks: its last token must be computed)."""
    from api.admission import PrefixLookup

    cache_on(summaries, 0, list(range(48)))
    lookup = PrefixLookup(summaries, 16)
    assert [lookup.tokens(0, 4242, list(range(n))) for n in (15, 16, 17, 32, 33, 48, 49)] == \
        [0, 0, 16, 16, 32, 32, 48]


def test_a_full_pool_still_admits_the_request_to_wait_in_bootstrap():
    engine = Engine(kv_blocks_free=0)
    handle, = engine.core.admit(request("a"))
    assert engine.table.rows[handle.slot]["state"] == S.QUEUED and len(engine.outbox.sent) == 1


def test_a_full_table_rolls_back_every_row_it_took():
    engine = Engine(num_rows=2)
    with pytest.raises(EngineOverloadedError, match="table full"):
        engine.core.admit(request(n=3))
    assert_nothing_held(engine)
    assert len(engine.table.released) == 2   # both rows it took were aborted and released


@pytest.mark.parametrize("refusal, error", [(QueueFullError("full"), EngineOverloadedError),
                                            (MessageTooLargeError("big"), InvalidRequestError)])
def test_a_refused_prefill_queue_rolls_back_every_row(refusal, error):
    engine = Engine()
    engine.outbox.refuse["prefill0"] = refusal
    with pytest.raises(error):
        engine.core.admit(request(n=2))
    assert_nothing_held(engine)
    assert len(engine.table.released) == 2
    assert engine.actors.routed == {0: 0, 1: 0, 2: 0, 3: 0}


def test_a_draining_engine_refuses_new_requests():
    engine = Engine()
    engine.draining = True
    with pytest.raises(EngineOverloadedError, match="draining"):
        engine.core.admit(request())
    assert_nothing_held(engine)


@pytest.mark.parametrize("indices, field, value", [((0, 1), "health", ActorHealth.HUNG),
                                                   ((2, 3), "health", ActorHealth.DEAD),
                                                   ((0, 1), "status", ActorStatus.RESTARTING)])
def test_no_actor_serving_a_role_refuses_the_request(indices, field, value):
    engine = Engine()
    for i in indices:
        engine.actors.table[i][field] = value
    with pytest.raises(EngineOverloadedError, match="serving"):
        engine.core.admit(request())
    assert_nothing_held(engine)


def test_an_unhealthy_actor_is_skipped():
    engine = Engine()
    engine.actors.table[0]["health"] = ActorHealth.HUNG
    engine.actors.table[2]["status"] = ActorStatus.STARTING
    handle, = engine.core.admit(request())
    assert (handle.prefill_actor, handle.decode_actor) == (1, 3) and engine.outbox.sent[0][0] == "prefill1"


def test_colocated_sends_the_prompt_to_the_decode_actor_with_no_prefill_actor():
    engine = Engine(prefill=(), decode=(0, 1))
    engine.actors.table[0]["kv_blocks_free"] = 50
    handle, = engine.core.admit(request())
    assert engine.table.rows[handle.slot]["prefill_actor"] == NO_ACTOR and handle.decode_actor == 1
    (dest, message), = engine.outbox.sent
    assert dest == "decode1" and message.decode_actor == LOCAL_DECODE
    assert engine.actors.routed == {0: 0, 1: 1}


def test_a_prefill_node_sends_to_a_remote_decode_and_counts_only_its_own_actor():
    engine = Engine(role="prefill", prefill=(0, 1), decode=())
    handle, = engine.core.admit(request(), remote_decode=True)
    assert (handle.prefill_actor, handle.decode_actor) == (0, REMOTE_ACTOR)
    (dest, message), = engine.outbox.sent
    assert dest == "prefill0" and message.decode_actor == REMOTE
    assert engine.actors.routed == {0: 1, 1: 0}
    with pytest.raises(InvalidRequestError, match="prefill side only"):
        engine.core.admit(request("local"))   # a prompt for this node's own decode: it has none
    both = Engine()
    with pytest.raises(InvalidRequestError, match="both sides"):
        both.core.admit(request(), remote_decode=True)
    assert_nothing_held(both)


def test_a_decode_node_admits_a_prefilled_request_at_bootstrap_on_the_most_free_actor():
    engine = Engine(role="decode", prefill=(), decode=(0, 1))
    engine.actors.table[1]["kv_blocks_free"] = 200
    ready = kv_ready(num_tokens=40, max_tokens=9)
    handle = engine.core.admit_prefilled(request(), ready, timeout_s=5.0)
    row = engine.table.rows[handle.slot]
    assert row["state"] == S.BOOTSTRAP and row["owner"] == API and row["decode_actor"] == 1
    assert row["prompt_tokens"] == 40 and row["deadline_ns"] == engine.clock() + 5_000_000_000
    assert handle.reserve_blocks == 4 and handle.prefill_actor == NO_ACTOR   # ceil(49 / 16)
    (dest, message), = engine.outbox.sent
    assert dest == "decode1" and isinstance(message, KVReady)
    assert (message.slot, message.generation) == handle.key and message.prefill_actor == REMOTE
    assert message.peer == ready.peer and message.src_block_ids == ready.src_block_ids
    assert engine.actors.routed == {0: 0, 1: 1}


def test_a_prefilled_request_is_refused_without_a_peer_off_a_decode_node_and_rolled_back_on_a_full_inbox():
    engine = Engine(role="decode", prefill=(), decode=(0, 1))
    with pytest.raises(InvalidRequestError, match="peer"):
        engine.core.admit_prefilled(request(), kv_ready(peer=""))
    engine.outbox.refuse["decode0"] = QueueFullError("full")
    with pytest.raises(EngineOverloadedError, match="inbox refused"):
        engine.core.admit_prefilled(request(), kv_ready())
    assert_nothing_held(engine)
    assert len(engine.table.released) == 1
    with pytest.raises(InvalidRequestError, match="only a decode node"):
        Engine().core.admit_prefilled(request(), kv_ready())


def test_transfer_done_finishes_and_releases_the_row_and_wakes_its_prefill_actor_once():
    engine = Engine(role="prefill", prefill=(0, 1), decode=())
    handle, = engine.core.admit(request(), remote_decode=True)
    engine.outbox.sent.clear()
    engine.table.transition(*handle.key, S.PREFILLING)
    engine.table.transition(*handle.key, S.BOOTSTRAP)
    assert engine.core.transfer_done(*handle.key)
    assert engine.table.rows == {} and engine.table.released == [handle.key]
    assert engine.outbox.sent == [("prefill0", TransferDone(*handle.key))]
    assert engine.actors.routed == {0: 0, 1: 0}
    assert not engine.core.transfer_done(*handle.key)   # late: a second one
    assert engine.core.stale_messages["transfer_done"] == 1 and len(engine.outbox.sent) == 1


def test_a_transfer_done_after_the_client_left_is_late_and_changes_nothing():
    engine = Engine(role="prefill", prefill=(0, 1), decode=())
    handle, = engine.core.admit(request(), remote_decode=True)
    engine.outbox.sent.clear()
    engine.core.release(handle)   # the client left: the row is ABORTED and released
    assert engine.table.released == [handle.key]
    assert not engine.core.transfer_done(*handle.key)
    assert engine.outbox.sent == [] and engine.core.stale_messages["transfer_done"] == 1


def test_a_transfer_done_whose_wake_up_is_refused_still_ends_the_row():
    engine = Engine(role="prefill", prefill=(0, 1), decode=())
    handle, = engine.core.admit(request(), remote_decode=True)
    engine.table.transition(*handle.key, S.PREFILLING)
    engine.table.transition(*handle.key, S.BOOTSTRAP)
    engine.outbox.refuse["prefill0"] = QueueFullError("full")
    assert engine.core.transfer_done(*handle.key)
    assert engine.table.released == [handle.key] and engine.core.handles == {}


def test_a_stop_string_finishes_the_row_and_release_frees_it_without_aborting():
    engine = Engine()
    handle, = engine.core.admit(request())
    for state in (S.PREFILLING, S.BOOTSTRAP, S.TRANSFERRING, S.DECODE_WAITING, S.DECODING):
        engine.table.transition(*handle.key, state)
    engine.core.stop(handle)
    assert engine.table.rows[handle.slot]["state"] == S.FINISHED and engine.table.rows[handle.slot]["owner"] == API
    engine.core.release(handle)
    assert engine.table.released == [handle.key] and engine.core.handles == {}
    assert engine.actors.routed == {0: 0, 1: 0, 2: 0, 3: 0}
    engine.core.release(handle)   # twice: a no-op
    assert engine.table.released == [handle.key]


def test_release_aborts_a_live_row_before_freeing_it():
    engine = Engine()
    handle, = engine.core.admit(request())
    engine.table.transition(*handle.key, S.PREFILLING)
    seen = []
    transition = engine.table.transition
    engine.table.transition = lambda *a, **k: seen.append(a[2]) or transition(*a, **k)
    engine.core.release(handle)
    assert seen == [S.ABORTED] and engine.table.released == [handle.key]


def test_a_row_that_ended_without_its_last_message_is_lost_after_the_grace_and_only_once():
    """An actor that dies between moving a row to FINISHED and sending its last TokenBatch leaves the API's handle
    waiting: ``lost`` names it once the row has been ended for ``grace_ns`` (the caller fails it with a 502), never
    a handle whose end arrived, nor one whose row is live."""
    engine = Engine()
    dead, done, live, freed = engine.core.admit(request("dead")) + engine.core.admit(request("done")) + \
        engine.core.admit(request("live")) + engine.core.admit(request("freed"))
    for handle in (dead, done, freed):
        for state in (S.PREFILLING, S.BOOTSTRAP, S.TRANSFERRING, S.DECODE_WAITING, S.DECODING, S.FINISHED):
            assert engine.table.transition(*handle.key, state)
    done.ended = True   # its finish reason reached the API
    assert engine.table.release(*freed.key)   # the monitor reclaimed the abandoned final row
    grace_ns = 5_000_000_000
    now = engine.clock()
    assert engine.core.lost(now, grace_ns) == []              # first seen: the grace starts
    assert engine.core.lost(now + grace_ns - 1, grace_ns) == []
    assert engine.core.lost(now + grace_ns, grace_ns) == [dead, freed]
    assert dead.ended and freed.ended and not live.ended
    assert engine.core.lost(now + 2 * grace_ns, grace_ns) == []   # each once
    for state in (S.PREFILLING, S.BOOTSTRAP, S.TRANSFERRING, S.DECODE_WAITING, S.DECODING):
        assert engine.table.transition(*live.key, state)
    engine.core.stop(live)   # a stop string: the API ends the row itself, nothing is lost
    assert engine.core.lost(now + 3 * grace_ns, grace_ns) == [] and live.ended


# ---- embeddings: a row and an EmbedRequest per input, to a prefill actor only -----------------------------------
def embedding_input(k: int = 0, prompt_tokens: int = 20):
    from api.embeddings import EmbeddingInput

    return EmbeddingInput("e", list(range(1, prompt_tokens + 1)), k)


def test_an_embedding_input_gets_a_queued_row_naming_no_decode_actor_and_one_embed_request():
    from actors.messages import EmbedRequest

    engine = Engine()
    engine.config = dataclasses.replace(engine.config, pooling="mean")
    engine.core.config = engine.config
    first = engine.core.admit_embedding(embedding_input(0, prompt_tokens=3000))
    second = engine.core.admit_embedding(embedding_input(1))
    rows = [engine.table.rows[h.slot] for h in (first, second)]
    assert all(r["state"] == S.QUEUED and r["decode_actor"] == NO_ACTOR for r in rows)
    assert [r["prefill_actor"] for r in rows] == [0, 1]   # the second goes where fewer prompt tokens wait
    assert [(d, type(m), m.pooling, (m.slot, m.generation)) for d, m in engine.outbox.sent] == [
        ("prefill0", EmbedRequest, "mean", first.key), ("prefill1", EmbedRequest, "mean", second.key)]
    assert first.index == 0 and second.index == 1
    assert engine.actors.routed == {0: 1, 1: 1, 2: 0, 3: 0}   # counted on no decode actor
    engine.core.release_all([first, second])
    engine.outbox.sent.clear()
    assert_nothing_held(engine)


def test_colocated_an_embedding_goes_to_a_decode_actors_prefill_core_and_a_decode_node_refuses_it():
    from actors.messages import EmbedRequest

    engine = Engine(prefill=(), decode=(0, 1))
    handle = engine.core.admit_embedding(embedding_input())
    row = engine.table.rows[handle.slot]
    assert (row["prefill_actor"], row["decode_actor"]) == (NO_ACTOR, 0)
    [(dest, message)] = engine.outbox.sent
    assert dest == "decode0" and isinstance(message, EmbedRequest)
    decode_node = Engine(role="decode", prefill=(), decode=(0,))
    with pytest.raises(InvalidRequestError, match="decode side only"):
        decode_node.core.admit_embedding(embedding_input())
    assert_nothing_held(decode_node)


@pytest.mark.parametrize("refusal", [QueueFullError("full"), MessageTooLargeError("too large")])
def test_a_refused_embedding_input_leaves_no_row_and_a_full_engine_refuses_it(refusal):
    engine = Engine()
    engine.outbox.refuse["prefill0"] = refusal
    with pytest.raises(EngineOverloadedError if isinstance(refusal, QueueFullError) else InvalidRequestError):
        engine.core.admit_embedding(embedding_input())
    assert_nothing_held(engine)
    del engine.outbox.refuse["prefill0"]
    held = [engine.core.admit_embedding(embedding_input(k)) for k in range(MAX_QUEUED)]
    with pytest.raises(EngineOverloadedError, match="sequences in flight"):
        engine.core.admit_embedding(embedding_input())
    engine.core.release_all(held)
    engine.draining = True
    with pytest.raises(EngineOverloadedError, match="draining"):
        engine.core.admit_embedding(embedding_input())


def test_a_drained_actor_gets_no_client_work_but_a_drill_pinned_to_it_does():
    engine = Engine()
    engine.actors.table[3]["drained"] = int(S.TRANSFERRING)   # decode1: the monitor drained it
    engine.actors.table[2]["kv_blocks_free"] = 10              # decode0 looks fuller: decode1 would be chosen
    for i in range(3):
        handle, = engine.core.admit(request(f"r{i}"))
        assert handle.decode_actor == 2
    drill, = engine.core.admit(request("drill-decode_waiting-1"), pin=3)
    assert drill.decode_actor == 3 and engine.outbox.sent[-1][1].decode_actor == "decode1"
    engine.actors.table[3]["health"] = ActorHealth.HUNG        # a pinned actor must still be healthy
    with pytest.raises(EngineOverloadedError, match="serving"):
        engine.core.admit(request("drill-decode_waiting-2"), pin=3)
    with pytest.raises(ValueError, match="only a watchdog drill"):
        engine.core.admit(request("client"), pin=2)


@pytest.mark.parametrize("health", [ActorHealth.DEAD, ActorHealth.HUNG])
def test_a_drained_actor_takes_client_work_again_when_the_other_of_its_role_dies_or_hangs(health):
    engine = Engine()
    engine.actors.table[3]["drained"] = int(S.TRANSFERRING)   # decode1 drained while decode0 served
    engine.actors.table[2]["health"] = health                 # then decode0 died (or hung)
    handle, = engine.core.admit(request("r0"))
    assert handle.decode_actor == 3   # not a 503 while a working decode actor exists
    engine.actors.table[3]["health"] = ActorHealth.HUNG       # and none left at all: the retryable 503
    with pytest.raises(EngineOverloadedError, match="serving"):
        engine.core.admit(request("r1"))
