"""The prefill and decode scheduler cores over in-memory ports (tests/actors/fakes.py): every admission,
reservation, transfer, abort and clean-up rule without a process. Each case checks the blocks freed on both
sides and the messages sent."""
from __future__ import annotations

import dataclasses

import pytest

from actors.decode_core import DecodeCore
from actors.messages import (EmbedRequest, Embedding, HandBackDone, KVHandBack, KVReady, PrefillRequest, PromptLogprobs,
                             from_wire, RequestError, TokenBatch, TransferDone)
from actors.ports import QueueOutbox
from actors.prefill_core import PrefillCore
from actors.prefix_cache import CACHE_OWNER, HANDBACK_OWNER, CachingAllocator
from actors.topology import LOCAL_DECODE, LOCAL_PREFILL
from ipc.lifecycle import RequestState as S
from tests.actors.fakes import FakeAllocator, FakeClock, FakeTable, FakeTransfers, Outbox, prefill_request

PREFILL, DECODE = 0, 1
PREFILL_AT, DECODE_AT = "prefill0", "decode0"   # their addresses (actors/topology.py) in an N x M engine
EOS = 0


class Pair:
    """One prefill core and one decode core sharing a table, each with its own pool; ``run()`` plays the shells'
    loops (the forward passes give fixed first tokens and next tokens)."""

    def __init__(self, prefill_blocks: int = 32, decode_blocks: int = 32, max_num_seqs: int = 8,
                 prefix_cache: bool = False):
        self.clock = FakeClock()
        self.table = FakeTable(self.clock)
        self.prefill_pool, self.decode_pool = FakeAllocator(prefill_blocks), FakeAllocator(decode_blocks)
        self.cache = CachingAllocator(self.prefill_pool, enabled=prefix_cache)
        self.to_decode, self.to_prefill_and_api = Outbox(), Outbox()
        self.late = 0
        self.prefill = PrefillCore(self.table, self.cache, self.to_decode, self.clock, actor_index=PREFILL,
                                   on_late=self._late)
        self.transfers = FakeTransfers()
        self.decode = DecodeCore(self.table, self.decode_pool, self.transfers, self.to_prefill_and_api, self.clock,
                                 actor_index=DECODE, eos_ids=[EOS], max_num_seqs=max_num_seqs, block_bytes=100)
        self.tokens: list[list] = []   # TokenBatch rows the API got
        self.errors: list[RequestError] = []

    def _late(self):
        self.late += 1

    def prefill_step(self, first_token: int = 5) -> None:
        """One forward pass of the prefill shell: every prompt it completes gets ``first_token`` on each row."""
        self.prefill.reap()
        chunks = self.prefill.next_batch()
        for work in self.prefill.batch_done(chunks):
            self.prefill.finish(work, [(first_token, None)] * len(work.rows))

    def deliver_to_decode(self) -> list[KVReady]:
        readies = self.to_decode.take(LOCAL_DECODE)
        for ready in readies:
            self.decode.on_message(ready)
        return readies

    def decode_step(self, next_token: int = 7) -> None:
        self.decode.reap()
        self.decode.start_transfers()
        self.decode.poll_transfers()
        self.decode.join_batch()
        batch = self.decode.batch()
        if batch:
            self.decode.step_done(batch, [next_token] * len(batch), [None] * len(batch))
        self.decode.flush()
        for batch_message in self.to_prefill_and_api.take("api", TokenBatch):
            self.tokens.extend(batch_message.items)
        self.errors.extend(self.to_prefill_and_api.take("api", RequestError))

    def deliver_to_prefill(self) -> list[TransferDone]:
        dones = self.to_prefill_and_api.take(LOCAL_PREFILL)
        for done in dones:
            self.prefill.on_message(done)
        return dones

    def run(self, rounds: int = 8) -> None:
        for _ in range(rounds):
            self.prefill_step()
            self.deliver_to_decode()
            self.decode_step()
            self.deliver_to_prefill()

    def assert_all_free(self) -> None:
        """Every block free; with the prefix cache, free or cached with no request holding it."""
        assert self.cache.num_free == self.prefill_pool.num_blocks and self.cache.cached_blocks_in_use == 0
        assert self.decode_pool.num_free == self.decode_pool.num_blocks
        assert not self.prefill.inflight and not self.prefill.queued
        assert not (self.decode.bootstrap or self.decode.transferring or self.decode.decode_waiting
                    or self.decode.decoding)


def abort(pair: Pair, key) -> None:
    assert pair.table.transition(*key, S.ABORTED)


def prefill_one(core: PrefillCore):
    """Plan a forward pass that holds exactly one whole prompt (after its cached prefix, if any) and report it
    done; returns the prompt's work."""
    [chunk] = core.next_batch()
    assert chunk.start == chunk.work.cached_tokens and chunk.last
    assert core.batch_done([chunk]) == [chunk.work]
    return chunk.work


def spans(chunks) -> list[tuple[str, int, int]]:
    return [(c.work.request.request_id, c.start, c.end) for c in chunks]


def test_a_request_goes_through_every_state_and_both_pools_end_free():
    pair = Pair()
    request = prefill_request(pair.table, "r1", prompt_tokens=20, max_tokens=3)
    key = (request.slot, request.generation)
    pair.prefill.on_message(request)
    pair.prefill_step()
    assert pair.table.state(key) == S.BOOTSTRAP and pair.prefill_pool.num_free == 32 - 2
    [ready] = pair.deliver_to_decode()
    assert ready.src_block_ids == pair.prefill.inflight[key].blocks and ready.first_token == 5
    pair.decode_step()
    # decode moved its own row to DECODING through DECODE_WAITING; prefill still holds its blocks until told
    assert pair.table.state(key) == S.DECODING and pair.prefill_pool.num_free == 30
    assert pair.decode_pool.num_free == 32 - 2   # ceil((20 + 3) / 16)
    assert pair.deliver_to_prefill() == [TransferDone(*key)]
    assert pair.prefill_pool.num_free == 32 and pair.table.rows[key[0]]["prefill_blocks"] == 0
    pair.decode_step()
    assert pair.table.state(key) == S.FINISHED
    assert [t[2:4] for t in pair.tokens] == [[5, None], [7, None], [7, "length"]]
    assert pair.tokens[0][4]["timings"]["transfer_bytes"] == 2 * 100
    assert pair.table.rows[key[0]]["output_tokens"] == 3
    pair.assert_all_free()


def test_first_tokens_go_out_at_admission_and_each_step_writes_the_batch_in_one_round_trip():
    pair = Pair()
    requests = [prefill_request(pair.table, f"r{i}", prompt_tokens=20, max_tokens=3) for i in range(3)]
    keys = [(r.slot, r.generation) for r in requests]
    for request in requests:
        pair.prefill.on_message(request)
    pair.prefill_step()
    pair.deliver_to_decode()
    pair.decode.reap()
    pair.decode.start_transfers()
    pair.decode.poll_transfers()
    round_trips = []
    pair.table.update_many = lambda updates, real=pair.table.update_many: round_trips.append(len(updates)) or \
        real(updates)
    joined = pair.decode.join_batch()
    # before any decode step: the API holds every first token (sampled by prefill), the table counts it
    [first] = pair.to_prefill_and_api.take("api", TokenBatch)
    assert [(i[0], i[1], i[2], i[3]) for i in first.items] == [(*k, 5, None) for k in keys]
    assert all("timings" in i[4] for i in first.items) and round_trips == [3]
    assert all(pair.table.rows[k[0]]["output_tokens"] == 1 for k in keys)
    pair.decode.step_done(joined, [7] * 3, [None] * 3)
    pair.decode.flush()
    [second] = pair.to_prefill_and_api.take("api", TokenBatch)
    assert [i[2] for i in second.items] == [7, 7, 7] and round_trips == [3, 3]   # the whole batch: one update_many
    assert all(pair.table.rows[k[0]]["output_tokens"] == 2 for k in keys)


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("state", [S.QUEUED, S.PREFILLING, S.BOOTSTRAP, S.TRANSFERRING, S.DECODE_WAITING])
def test_an_abort_in_each_stage_frees_both_sides_once_and_sends_nothing_more(state, prefix_cache):
    pair = Pair(max_num_seqs=1, prefix_cache=prefix_cache)
    blocker = prefill_request(pair.table, "blocker", max_tokens=50)   # holds the only batch slot
    request = prefill_request(pair.table, "victim")
    key = (request.slot, request.generation)
    pair.prefill.on_message(blocker)
    pair.run(1)
    if state == S.TRANSFERRING:
        pair.transfers.script["victim"] = 0   # in progress until the abort
    pair.prefill.on_message(request)
    if state == S.QUEUED:
        abort(pair, key)
    else:
        [chunk] = pair.prefill.next_batch()
        assert pair.table.state(key) == S.PREFILLING
        assert chunk.work.cached_tokens == (16 if prefix_cache else 0)   # the blocker's prompt is the same
        if state == S.PREFILLING:
            abort(pair, key)
            assert pair.prefill.batch_done([chunk]) == []   # not finished: its blocks are freed now
            assert not pair.prefill.prefilling
        else:
            assert pair.prefill.batch_done([chunk]) == [chunk.work]
            pair.prefill.finish(chunk.work, [(5, None)])
            pair.deliver_to_decode()
            if state != S.BOOTSTRAP:
                pair.decode.start_transfers()
                pair.decode.poll_transfers()
            assert pair.table.state(key) == state
            abort(pair, key)
    pair.run(2)
    assert not [t for t in pair.tokens if t[0] == key[0]], "an aborted request produced tokens"
    held_by_victim = [b for b, o in pair.prefill_pool.owner.items() if o == key[0]]
    held_by_victim += [b for b, o in pair.decode_pool.owner.items() if o == key[0]]
    assert held_by_victim == []
    assert pair.cache.cached_blocks_in_use == 0
    if state == S.TRANSFERRING:
        assert pair.transfers.released, "the transfer handle was not released"
    abort(pair, (blocker.slot, blocker.generation))
    pair.run(2)
    pair.assert_all_free()


def test_a_late_and_a_duplicate_transfer_done_are_counted_and_ignored():
    pair = Pair()
    request = prefill_request(pair.table, "r", max_tokens=1)
    key = (request.slot, request.generation)
    pair.prefill.on_message(request)
    pair.prefill_step()
    pair.deliver_to_decode()
    pair.decode_step()
    done = pair.to_prefill_and_api.take(LOCAL_PREFILL)
    assert done == [TransferDone(*key)] and pair.table.state(key) == S.FINISHED
    pair.prefill.reap()   # the row is final: prefill frees without the message
    assert pair.prefill_pool.num_free == 32
    pair.prefill.on_message(done[0])   # late
    pair.prefill.on_message(done[0])   # duplicate
    assert pair.late == 2
    pair.assert_all_free()


def test_a_lost_transfer_done_pins_nothing_prefill_frees_once_decode_moved_on():
    pair = Pair()
    request = prefill_request(pair.table, "lost", max_tokens=20)
    key = (request.slot, request.generation)
    pair.prefill.on_message(request)
    pair.prefill_step()
    pair.deliver_to_decode()
    pair.decode_step()
    assert pair.to_prefill_and_api.take(LOCAL_PREFILL)   # dropped on the floor
    assert pair.table.state(key) == S.DECODING and pair.prefill_pool.num_free == 30
    assert pair.prefill.own_gauges()["prefill_inflight"] == 1
    pair.prefill.reap()
    assert pair.prefill_pool.num_free == 32 and pair.prefill.own_gauges()["prefill_inflight"] == 0
    assert pair.late == 0


@pytest.mark.parametrize("status, words", [(2, "failed"), (7, "unknown status 7")])
def test_a_failed_or_unknown_transfer_status_fails_the_request_retryably_and_frees_both_sides(status, words):
    pair = Pair()
    request = prefill_request(pair.table, "bad")
    key = (request.slot, request.generation)
    pair.transfers.script["bad"] = status
    pair.prefill.on_message(request)
    pair.run(2)
    assert pair.table.state(key) == S.FAILED
    [error] = pair.errors
    assert error.http_status == 503 and "stage transfer" in error.message and words in error.message
    assert not pair.tokens
    pair.assert_all_free()


def test_a_full_decode_pool_keeps_the_request_in_bootstrap_and_renews_it_while_tokens_flow():
    pair = Pair(decode_blocks=4)
    big = prefill_request(pair.table, "big", prompt_tokens=20, max_tokens=40)   # 4 blocks: the whole pool
    small = prefill_request(pair.table, "small", prompt_tokens=10, max_tokens=2)
    small_key = (small.slot, small.generation)
    pair.prefill.on_message(big)
    pair.prefill.on_message(small)
    pair.run(2)
    assert pair.table.state(small_key) == S.BOOTSTRAP and pair.decode_pool.num_free == 0
    entered_ns = pair.table.rows[small.slot]["state_since_ns"]
    pair.clock.advance(2.0)
    pair.run(1)   # the big one's tokens renew the waiting row
    assert pair.table.rows[small.slot]["last_progress_ns"] > entered_ns
    pair.run(40)
    assert pair.table.state(small_key) == S.FINISHED
    pair.assert_all_free()


def test_n_children_share_one_prefill_and_each_gets_its_own_decode_sequence():
    pair = Pair()
    request = prefill_request(pair.table, "n3", prompt_tokens=20, max_tokens=2, n=3, seed=11)
    pair.prefill.on_message(request)
    work = prefill_one(pair.prefill)
    assert len(work.rows) == 3 and pair.prefill_pool.num_free == 30   # one prompt's blocks for all three
    assert [s.seed for s in work.samplings] == [11, 12, 13]
    pair.prefill.finish(work, [(5, None), (6, None), (8, None)])
    readies = pair.deliver_to_decode()
    assert [r.first_token for r in readies] == [5, 6, 8]
    assert len({tuple(r.src_block_ids) for r in readies}) == 1
    pair.decode_step()
    assert pair.prefill_pool.num_free == 30   # held until the last child's copy is acknowledged
    dones = pair.deliver_to_prefill()
    assert len(dones) == 3 and pair.prefill_pool.num_free == 32
    pair.run(2)
    assert sorted(t[0] for t in pair.tokens if t[3] == "length") == sorted(k for k, _ in
                                                                           [(r.slot, r.generation) for r in readies])
    pair.assert_all_free()


def test_a_row_timed_out_by_the_monitor_while_its_copy_runs_is_released_on_both_sides():
    pair = Pair()
    request = prefill_request(pair.table, "slow")
    key = (request.slot, request.generation)
    pair.transfers.script["slow"] = 0   # IN_PROGRESS
    pair.prefill.on_message(request)
    pair.run(2)
    assert pair.table.state(key) == S.TRANSFERRING
    assert pair.decode.own_gauges()["decode_transfer"] == 1
    assert pair.table.transition(*key, S.TIMED_OUT)   # the monitor
    pair.run(1)
    assert pair.transfers.released and not pair.tokens and not pair.to_prefill_and_api.take(LOCAL_PREFILL)
    pair.assert_all_free()


def test_blocks_arriving_renew_the_transfer_deadline_and_a_transfer_with_none_does_not():
    pair = Pair()
    moving, stuck = prefill_request(pair.table, "moving"), prefill_request(pair.table, "stuck")
    pair.transfers.script.update(moving=0, stuck=0)
    for r in (moving, stuck):
        pair.prefill.on_message(r)
    pair.run(3)
    since = {r.request_id: pair.table.rows[r.slot]["last_progress_ns"] for r in (moving, stuck)}
    pair.clock.advance(1.0)
    handle = next(h for h, s in pair.transfers.started.items() if s[0] == "moving")
    pair.transfers.poll = lambda h, real=pair.transfers.poll: (0, 1) if h == handle else real(h)
    pair.decode_step()
    assert pair.table.rows[moving.slot]["last_progress_ns"] > since["moving"]
    assert pair.table.rows[stuck.slot]["last_progress_ns"] == since["stuck"]


def test_colocated_mode_runs_the_same_prefill_core_over_the_decode_pool():
    clock = FakeClock()
    table = FakeTable(clock)
    pool = FakeAllocator(16)
    api: list = []   # the API's shm queue: wire frames

    class ApiQueue:
        def put(self, frame, timeout_s):
            api.append(frame)
    local: dict = {"api": ApiQueue()}
    outbox = QueueOutbox(local, put_timeout_s=1.0)
    prefill = PrefillCore(table, pool, outbox, clock, actor_index=DECODE)
    decode = DecodeCore(table, pool, FakeTransfers(local=True), outbox, clock, actor_index=DECODE, eos_ids=[EOS],
                        max_num_seqs=4, block_bytes=100)
    outbox.add_local(LOCAL_PREFILL, prefill)
    outbox.add_local(LOCAL_DECODE, decode)
    request = prefill_request(table, "colo", prompt_tokens=20, max_tokens=2, n=2)
    prefill.on_message(request)
    work = prefill_one(prefill)
    prefill.finish(work, [(5, None), (6, None)])
    decode.start_transfers()   # the full prompt block once for both children, each its own partial block
    decode.poll_transfers()
    assert not prefill.inflight and pool.num_free == 16 - (1 + 2)   # prompt blocks freed by the local TransferDone
    decode.join_batch()
    batch = decode.batch()
    decode.step_done(batch, [7] * len(batch), [None] * len(batch))
    decode.flush()
    items = [i for frame in api for i in from_wire(frame).items]
    assert sorted((i[2], i[3]) for i in items) == [(5, None), (6, None), (7, "length"), (7, "length")]
    assert pool.num_free == 16 and all(table.state((r, 1)) == S.FINISHED for r in (0, 1))
    assert all(table.rows[r]["n_transfers"] == 0 for r in (0, 1)), "a copy inside one pool counted as a handoff"
    assert all(i[4]["timings"]["transfer_bytes"] == 0 for i in items if len(i) > 4)


def test_the_prefill_core_renews_each_chunk_and_drops_a_prompt_whose_rows_are_gone():
    pair = Pair()
    request = prefill_request(pair.table, "long", prompt_tokens=300)   # chunks of 128, 128, 44
    key = (request.slot, request.generation)
    pair.prefill.on_message(request)
    chunks = pair.prefill.next_batch()
    assert spans(chunks) == [("long", 0, 128)] and not chunks[0].last
    assert pair.prefill.own_gauges() == {"queued": 0, "prefill_inflight": 0, "running": 1}
    pair.clock.advance(3.0)
    assert pair.prefill.batch_done(chunks) == []   # not complete yet
    assert pair.table.rows[key[0]]["last_progress_ns"] == pair.clock()
    assert spans(pair.prefill.next_batch()) == [("long", 128, 256)]
    abort(pair, key)   # between two forward passes
    pair.prefill.reap()
    assert pair.prefill.next_batch() == [] and not pair.prefill.has_work()
    assert pair.prefill_pool.num_free == 32 and not pair.prefill.inflight


def test_queued_rows_behind_a_long_prompt_are_renewed_by_each_of_its_forward_passes():
    """A prompt longer than the queue deadline must not time out the requests queued behind it: every forward pass
    of prefill renews the QUEUED rows (at most once per renew interval), not only a completed prefill."""
    pair = Pair(prefill_blocks=19)
    long = prefill_request(pair.table, "long", prompt_tokens=300)   # chunks of 128, 128, 44; the whole pool
    waiting = prefill_request(pair.table, "waiting", prompt_tokens=20)
    pair.prefill.on_message(long)
    pair.prefill.on_message(waiting)
    for _ in range(2):
        pair.clock.advance(1.5)   # more than the renew interval (1 s)
        pair.prefill.reap()
        chunks = pair.prefill.next_batch()
        assert spans(chunks)[0][0] == "long" and not chunks[0].last and pair.prefill.blocked
        assert pair.prefill.batch_done(chunks) == []
        assert pair.table.state((waiting.slot, waiting.generation)) == S.QUEUED
        assert pair.table.rows[waiting.slot]["last_progress_ns"] == pair.clock()
    pair.clock.advance(0.5)   # within the interval: no second write
    pair.prefill.renew_queued()
    assert pair.table.rows[waiting.slot]["last_progress_ns"] == pair.clock() - int(0.5e9)
    pair.run(8)
    assert pair.table.state((waiting.slot, waiting.generation)) == S.FINISHED
    pair.assert_all_free()


def batching_pair(batch_tokens: int, chunk_tokens: int, prefill_blocks: int = 32, prefix_cache: bool = False) -> Pair:
    pair = Pair(prefill_blocks=prefill_blocks, prefix_cache=prefix_cache)
    pair.prefill.batch_tokens, pair.prefill.chunk_tokens = batch_tokens, chunk_tokens
    return pair


def test_one_forward_packs_queued_prompts_in_arrival_order_up_to_the_token_budget():
    pair = batching_pair(batch_tokens=64, chunk_tokens=32)
    for name, n in [("a", 10), ("b", 20), ("c", 50), ("d", 5), ("e", 7)]:
        pair.prefill.on_message(prefill_request(pair.table, name, prompt_tokens=n))
    first = pair.prefill.next_batch()
    # c is cut at chunk_tokens; d gets the 2 tokens left of the budget; e waits QUEUED
    assert spans(first) == [("a", 0, 10), ("b", 0, 20), ("c", 0, 32), ("d", 0, 2)]
    assert [c.last for c in first] == [True, True, False, False]
    assert [pair.table.state((r.slot, r.generation)) for r in pair.prefill.queued] == [S.QUEUED]
    assert pair.prefill.own_gauges() == {"queued": 1, "prefill_inflight": 0, "running": 4}
    assert [w.request.request_id for w in pair.prefill.batch_done(first)] == ["a", "b"]
    for work in [c.work for c in first[:2]]:
        pair.prefill.finish(work, [(5, None)])
    second = pair.prefill.next_batch()   # the prompts begun come first, then the queue
    assert spans(second) == [("c", 32, 50), ("d", 2, 5), ("e", 0, 7)]
    assert [w.request.request_id for w in pair.prefill.batch_done(second)] == ["c", "d", "e"]
    for work in [c.work for c in second]:
        pair.prefill.finish(work, [(5, None)])
    assert [r.request_id for r in pair.to_decode.take(LOCAL_DECODE)] == ["a", "b", "c", "d", "e"]
    assert pair.prefill.next_batch() == [] and not pair.prefill.prefilling


def test_a_long_prompt_advances_a_chunk_per_forward_beside_short_prompts_that_arrive_later():
    pair = batching_pair(batch_tokens=48, chunk_tokens=32)
    long = prefill_request(pair.table, "long", prompt_tokens=100)
    pair.prefill.on_message(long)
    first = pair.prefill.next_batch()
    assert spans(first) == [("long", 0, 32)] and pair.prefill.batch_done(first) == []
    pair.prefill.on_message(prefill_request(pair.table, "s1", prompt_tokens=6))
    pair.prefill.on_message(prefill_request(pair.table, "s2", prompt_tokens=12))
    chunks = pair.prefill.next_batch()
    assert spans(chunks) == [("long", 32, 64), ("s1", 0, 6), ("s2", 0, 10)]
    assert [w.request.request_id for w in pair.prefill.batch_done(chunks)] == ["s1"]
    pair.run(6)
    assert pair.table.state((long.slot, long.generation)) == S.FINISHED
    pair.assert_all_free()


def test_an_aborted_prompt_is_dropped_from_the_next_forward_and_the_others_go_on():
    pair = batching_pair(batch_tokens=96, chunk_tokens=32)
    keep, gone = prefill_request(pair.table, "keep", prompt_tokens=70), prefill_request(pair.table, "gone",
                                                                                        prompt_tokens=70)
    for r in (keep, gone):
        pair.prefill.on_message(r)
    chunks = pair.prefill.next_batch()
    assert spans(chunks) == [("keep", 0, 32), ("gone", 0, 32)]
    pair.prefill.batch_done(chunks)
    abort(pair, (gone.slot, gone.generation))
    pair.prefill.reap()
    assert spans(pair.prefill.next_batch()) == [("keep", 32, 64)]
    assert [o for o in pair.prefill_pool.owner.values() if o is not None] == [keep.slot] * 5   # gone's are free
    assert pair.table.rows[gone.slot]["prefill_blocks"] == 0
    pair.run(6)
    assert pair.table.state((keep.slot, keep.generation)) == S.FINISHED
    assert pair.table.state((gone.slot, gone.generation)) == S.ABORTED
    assert {t[0] for t in pair.tokens} == {keep.slot}
    pair.assert_all_free()


def test_a_request_that_finds_no_free_blocks_holds_the_queue_behind_it():
    pair = batching_pair(batch_tokens=512, chunk_tokens=128, prefill_blocks=4)
    big, small = prefill_request(pair.table, "big", prompt_tokens=64), prefill_request(pair.table, "small",
                                                                                      prompt_tokens=5)
    pair.prefill.on_message(prefill_request(pair.table, "first", prompt_tokens=20))   # 2 of the 4 blocks
    pair.prefill.on_message(big)     # needs all 4
    pair.prefill.on_message(small)   # would fit, but arrived after big (FIFO: no overtaking)
    assert spans(pair.prefill.next_batch()) == [("first", 0, 20)]
    assert pair.prefill.blocked and [r.request_id for r in pair.prefill.queued] == ["big", "small"]
    pair.run(8)
    assert all(pair.table.state((r.slot, r.generation)) == S.FINISHED for r in (big, small))
    pair.assert_all_free()


def test_a_full_prefill_pool_keeps_requests_queued_without_spinning():
    pair = Pair(prefill_blocks=2)
    first, second = prefill_request(pair.table, "a", prompt_tokens=32), prefill_request(pair.table, "b")
    pair.prefill.on_message(first)
    pair.prefill.on_message(second)
    pair.prefill_step()
    assert pair.prefill.next_batch() == [] and pair.prefill.blocked and not pair.prefill.has_work()
    assert pair.table.state((second.slot, second.generation)) == S.QUEUED
    pair.deliver_to_decode()
    pair.decode_step()
    pair.deliver_to_prefill()
    pair.run(6)
    assert pair.table.state((second.slot, second.generation)) == S.FINISHED
    pair.assert_all_free()


def test_prompt_logprob_frames_are_small_enough_for_a_queue_slot():
    from actors.model_runner import send_prompt_logprobs

    out = Outbox()
    entries = [None] + [[-0.5, [[1, -0.5]] * 21] for _ in range(999)]
    send_prompt_logprobs(out, 3, 1, entries, 20)
    frames = out.take("api", PromptLogprobs)
    assert sum(len(f.entries) for f in frames) == 1000 and [f.start for f in frames][:2] == [0, len(frames[0].entries)]


def test_a_request_whose_grammar_is_complete_ends_with_stop_before_max_tokens():
    """The decode shell marks an entry ``grammar_done`` once its grammar matcher is complete (actors/model_runner
    DecodeRunner); the core ends the request with "stop" on that token and frees its blocks."""
    pair = Pair()
    request = prefill_request(pair.table, "g1", prompt_tokens=20, max_tokens=50)
    key = (request.slot, request.generation)
    pair.prefill.on_message(request)
    pair.prefill_step()
    pair.deliver_to_decode()
    pair.decode_step()
    pair.deliver_to_prefill()
    pair.decode_step()
    assert pair.table.state(key) == S.DECODING
    for entry in pair.decode.batch():
        entry.grammar_done = True
    pair.decode_step()
    assert pair.table.state(key) == S.FINISHED
    reasons = [t[3] for t in pair.tokens]
    assert reasons[-1] == "stop" and reasons[:-1] == [None] * (len(reasons) - 1) and len(reasons) < 50
    pair.assert_all_free()


# ---- prefix cache ---------------------------------------------------------------------------------------------
def test_a_repeated_prompt_prefills_only_after_its_cached_prefix_and_ships_every_block():
    pair = Pair(prefix_cache=True)
    first = prefill_request(pair.table, "r1", prompt_tokens=40, max_tokens=1)   # blocks of 16: two full, one part
    pair.prefill.on_message(first)
    pair.run(2)
    assert pair.cache.cached_blocks == 2 and pair.cache.num_free == 32
    second = prefill_request(pair.table, "r2", prompt_tokens=40, max_tokens=1)
    pair.prefill.on_message(second)
    work = prefill_one(pair.prefill)
    assert work.cached_tokens == 32 and work.blocks[:2] == [b for b, o in pair.prefill_pool.owner.items()
                                                             if o == CACHE_OWNER]
    pair.prefill.finish(work, [(5, None)])
    [ready] = pair.deliver_to_decode()
    assert ready.cached_tokens == 32 and ready.src_block_ids == work.blocks and len(work.blocks) == 3
    pair.decode_step()
    assert pair.tokens[-1][4]["timings"]["cached_tokens"] == 32
    pair.deliver_to_prefill()
    assert (pair.cache.query_tokens, pair.cache.hit_tokens) == (80, 32)
    pair.assert_all_free()


@pytest.mark.parametrize("end", ["timeout", "stop"])
def test_a_timed_out_request_and_a_stopping_actor_release_their_references_to_cached_blocks(end):
    """The monitor times out a request that holds cached blocks while its copy runs; or the actor stops (a
    restart: the shell calls stop()): no cached block stays held."""
    pair = Pair(prefix_cache=True)
    warm = prefill_request(pair.table, "warm", prompt_tokens=40, max_tokens=1)
    pair.prefill.on_message(warm)
    pair.run(2)
    stuck = prefill_request(pair.table, "stuck", prompt_tokens=40)
    pair.transfers.script["stuck"] = 0   # IN_PROGRESS forever
    pair.prefill.on_message(stuck)
    pair.run(2)
    assert pair.table.state((stuck.slot, stuck.generation)) == S.TRANSFERRING
    assert pair.cache.cached_blocks_in_use == 2
    if end == "timeout":
        assert pair.table.transition(stuck.slot, stuck.generation, S.TIMED_OUT)   # the monitor
        pair.run(1)
    else:
        pair.prefill.stop()
        pair.decode.stop()
    assert pair.cache.cached_blocks_in_use == 0 and pair.cache.cached_blocks == 2
    pair.assert_all_free()


def test_under_pressure_cached_blocks_are_evicted_for_new_prompts_and_never_while_held():
    pair = Pair(prefill_blocks=4, prefix_cache=True)
    a = prefill_request(pair.table, "a", prompt_tokens=33, max_tokens=1)   # 3 blocks, 2 cached after
    pair.prefill.on_message(a)
    pair.run(2)
    assert pair.cache.cached_blocks == 2
    b = prefill_request(pair.table, "b", prompt_tokens=64, max_tokens=1)   # 4 blocks: evicts both of a's
    b = PrefillRequest(b.slot, b.generation, "b", [t + 1000 for t in b.prompt_ids], b.sampling)
    pair.prefill.on_message(b)
    pair.run(2)
    assert pair.table.state((b.slot, b.generation)) == S.FINISHED
    assert pair.cache.evicted_blocks == 2 and pair.cache.cached_blocks == 4
    again = prefill_request(pair.table, "a2", prompt_tokens=33, max_tokens=1)
    pair.prefill.on_message(again)
    work = prefill_one(pair.prefill)
    assert work.cached_tokens == 0   # a's blocks were evicted: computed again, into evicted blocks of b
    pair.prefill.finish(work, [(5, None)])
    pair.run(2)
    pair.assert_all_free()


@pytest.mark.parametrize("how", ["beside-it", "abandoned"])
def test_a_prompt_is_cached_once_its_prefill_finished_never_at_admission_nor_when_abandoned(how):
    """Its blocks hold KV only once its last chunk ran: the same prompt admitted while the first one is still
    being prefilled, or after it was aborted half-way, computes everything again (cached_tokens 0: reusing those
    blocks would read KV never written, silently wrong text). Once the first finishes, the prompt is a hit."""
    pair = batching_pair(batch_tokens=512, chunk_tokens=16, prefix_cache=True)
    first = prefill_request(pair.table, "first", prompt_tokens=40, max_tokens=1)   # 3 chunks of 16, 16, 8
    pair.prefill.on_message(first)
    chunks = pair.prefill.next_batch()
    assert spans(chunks) == [("first", 0, 16)] and pair.prefill.batch_done(chunks) == []
    if how == "abandoned":
        abort(pair, (first.slot, first.generation))
        pair.prefill.reap()
        assert not pair.prefill.prefilling and pair.prefill_pool.num_free == 32
    second = prefill_request(pair.table, "second", prompt_tokens=40, max_tokens=1)
    pair.prefill.on_message(second)
    chunks = pair.prefill.next_batch()
    assert [c.work.cached_tokens for c in chunks if c.work.request is second] == [0]
    assert spans(chunks)[-1] == ("second", 0, 16) and pair.cache.cached_blocks == 0
    pair.prefill.batch_done(chunks)
    pair.run(6)
    assert pair.table.state((second.slot, second.generation)) == S.FINISHED and pair.cache.cached_blocks == 2
    third = prefill_request(pair.table, "third", prompt_tokens=40, max_tokens=1)
    pair.prefill.on_message(third)
    assert [c.work.cached_tokens for c in pair.prefill.next_batch()] == [32]   # a finished prompt is reused
    pair.run(6)
    pair.assert_all_free()


@pytest.mark.parametrize("end", [S.TIMED_OUT, S.ABORTED], ids=["timed-out", "aborted"])
def test_two_requests_share_cached_blocks_the_committer_leaves_mid_transfer_and_a_third_prompt_waits(end):
    """``a`` caches its prompt's blocks, then stalls in its transfer; ``b`` (same prompt) reuses them and is pulled
    too. ``a`` times out (the monitor) or is aborted. A third prompt needing more blocks than are free besides
    ``b``'s waits in QUEUED: ``b``'s blocks are not evicted under its running pull, it finishes, every block is freed
    once (FakeAllocator raises on a double free) and then the third prompt runs in them."""
    pair = Pair(prefill_blocks=6, prefix_cache=True)
    a = prefill_request(pair.table, "a", prompt_tokens=40, max_tokens=2)   # 2 full blocks + 1 partial
    b = prefill_request(pair.table, "b", prompt_tokens=40, max_tokens=2)
    pair.transfers.script.update(a=IN_PROGRESS, b=IN_PROGRESS)
    pair.prefill.on_message(a)
    pair.run(2)
    pair.prefill.on_message(b)
    pair.run(2)
    a_key, b_key = (a.slot, a.generation), (b.slot, b.generation)
    assert pair.table.state(a_key) == pair.table.state(b_key) == S.TRANSFERRING
    b_blocks = pair.prefill.inflight[b_key].blocks
    shared = b_blocks[:2]
    assert pair.prefill.inflight[a_key].blocks[:2] == shared and pair.prefill.inflight[b_key].prompt.cached_tokens == 32
    assert [pair.cache.cache.refs(x) for x in shared] == [2, 2]
    assert pair.table.transition(*a_key, end)
    pair.run(1)
    assert a_key not in pair.prefill.inflight and [pair.cache.cache.refs(x) for x in shared] == [1, 1]
    assert pair.cache.num_free == 6 - 3   # b's 2 cached + 1 own are held; nothing else is
    c = prefill_request(pair.table, "c", prompt_tokens=64, max_tokens=1)   # 4 blocks of other tokens
    c = dataclasses.replace(c, prompt_ids=[t + 1000 for t in c.prompt_ids])
    pair.prefill.on_message(c)
    pair.run(2)
    assert pair.table.state((c.slot, c.generation)) == S.QUEUED and pair.prefill.blocked
    assert [pair.prefill_pool.owner[x] for x in shared] == [CACHE_OWNER] * 2
    assert pair.cache.cache.match(pair.prefill.inflight[b_key].prompt.keys) == shared
    [(_, pulled, _, _)] = [s for s in pair.transfers.started.values() if s[0] == "b"]
    assert pulled == b_blocks
    del pair.transfers.script["b"]
    pair.run(8)
    assert pair.table.state(b_key) == S.FINISHED and pair.table.state((c.slot, c.generation)) == S.FINISHED
    assert pair.table.state(a_key) == end and {t[0] for t in pair.tokens} == {b.slot, c.slot}
    pair.assert_all_free()


def test_colocated_mode_shares_one_caching_allocator_and_decode_reservations_evict_the_cache():
    clock = FakeClock()
    table = FakeTable(clock)
    pool = CachingAllocator(FakeAllocator(8))
    outbox = QueueOutbox({"api": type("ApiQueue", (), {"put": lambda self, frame, timeout_s: None})()}, 1.0)
    prefill = PrefillCore(table, pool, outbox, clock, actor_index=DECODE)
    decode = DecodeCore(table, pool, FakeTransfers(local=True), outbox, clock, actor_index=DECODE, eos_ids=[EOS],
                        max_num_seqs=4, block_bytes=100)
    outbox.add_local(LOCAL_PREFILL, prefill)
    outbox.add_local(LOCAL_DECODE, decode)

    def serve(request_id: str, max_tokens: int, offset: int = 0) -> None:
        request = prefill_request(table, request_id, prompt_tokens=40, max_tokens=max_tokens)
        prefill.on_message(dataclasses.replace(request, prompt_ids=[t + offset for t in request.prompt_ids]))
        prefill.finish(prefill_one(prefill), [(5, None)])
        decode.start_transfers()
        decode.poll_transfers()
        decode.join_batch()
        while decode.batch():
            decode.step_done(decode.batch(), [7] * len(decode.batch()), [None] * len(decode.batch()))
        decode.flush()

    serve("a", max_tokens=1)
    assert pool.cached_blocks == 2 and pool.num_free == 8
    serve("b", max_tokens=24, offset=100)   # another prompt: 3 new blocks + decode's 4 need one of a's
    assert pool.evicted_blocks == 1 and pool.num_free == 8 and pool.cached_blocks_in_use == 0
    assert pool.cached_blocks == 1 + 2 and table.state((1, 1)) == S.FINISHED


# ---- n > 1: the children hold the prompt's full blocks once in the decode pool ----------------------------------
IN_PROGRESS, FAILED = 0, 2   # TransferStatus values the fake transfers report


def children_in_transfer(pair: Pair, prompt_tokens: int, max_tokens: int, n: int = 3, stuck: bool = False):
    """Prefill one ``n``-choice request and reserve its children in decode (their pulls IN_PROGRESS when
    ``stuck``); returns (row keys, the shared prompt, the children's decode entries in arrival order)."""
    request = prefill_request(pair.table, "kids", prompt_tokens=prompt_tokens, max_tokens=max_tokens, n=n)
    if stuck:
        pair.transfers.script["kids"] = IN_PROGRESS
    pair.prefill.on_message(request)
    pair.prefill_step()
    readies = pair.deliver_to_decode()
    pair.decode.start_transfers()
    [shared] = pair.decode.prompts.values()
    keys = [(r.slot, r.generation) for r in readies]
    assert [e.key for e in pair.decode.transferring] == keys and shared.holders == set(keys)
    return keys, shared, list(pair.decode.transferring)


@pytest.mark.parametrize("prompt_tokens, partial", [(40, True), (32, False)], ids=["partial-block", "whole-blocks"])
def test_n_children_hold_the_prompts_full_blocks_once_and_each_pulls_only_its_partial_block(prompt_tokens, partial):
    pair = Pair(decode_blocks=5)   # 3 children x 3 blocks = 9 without sharing; 2 shared + 3 x 1 own with it
    keys, shared, entries = children_in_transfer(pair, prompt_tokens, max_tokens=4)
    assert pair.decode_pool.num_free == 0 and len(shared.blocks) == 2
    assert all(e.blocks[:2] == shared.blocks for e in entries)
    assert len({e.blocks[2] for e in entries}) == 3   # each child writes its tokens into a block of its own
    assert {b for b, o in pair.decode_pool.owner.items() if o is not None} == set(shared.blocks) | {
        e.blocks[2] for e in entries}
    src = pair.prefill.inflight[keys[0]].blocks
    started = [(s[1], s[2], s[3]) for s in pair.transfers.started.values()]
    first = (src, entries[0].blocks[:len(src)], prompt_tokens)   # the first child pulls the whole prompt
    partials = [(src[2:], e.blocks[2:3], prompt_tokens - 32) for e in entries[1:]] if partial else []
    assert started == [first] + partials
    assert [pair.table.rows[k[0]]["decode_blocks"] for k in keys] == [3, 3, 3]   # each row's block table
    pair.decode_step()
    timings = {t[0]: t[4]["timings"] for t in pair.tokens if len(t) > 4}
    assert [timings[k[0]]["transfer_bytes"] for k in keys] == [len(src) * 100] + [(len(src) - 2) * 100] * 2
    assert len(pair.deliver_to_prefill()) == 3 and pair.prefill_pool.num_free == 32
    pair.run(4)
    assert all(pair.table.state(k) == S.FINISHED for k in keys) and not pair.decode.prompts
    pair.assert_all_free()


@pytest.mark.parametrize("end", [S.ABORTED, S.TIMED_OUT])
def test_the_first_child_leaving_mid_pull_leaves_the_pull_running_for_its_siblings(end):
    pair = Pair()
    keys, shared, entries = children_in_transfer(pair, prompt_tokens=40, max_tokens=20, stuck=True)
    puller_partial, puller_generation = entries[0].blocks[2], entries[0].blocks[3]
    assert shared.puller == keys[0]
    assert pair.table.transition(*keys[0], end)   # the client or the monitor
    pair.decode_step()
    # its generation block is free; its partial block is still a target of the running pull: held, not reused
    assert pair.decode_pool.owner[puller_generation] is None and pair.decode_pool.owner[puller_partial] == keys[0][0]
    assert shared.holders == set(keys[1:]) and shared.pull is not None and shared.parked == [puller_partial]
    assert all(pair.table.state(k) == S.TRANSFERRING for k in keys[1:])
    del pair.transfers.script["kids"]   # the pull (and the siblings' partial pulls) complete
    pair.run(24)
    assert [pair.table.state(k) for k in keys] == [end, S.FINISHED, S.FINISHED]
    assert {t[0] for t in pair.tokens} == {k[0] for k in keys[1:]}
    pair.assert_all_free()
    assert not pair.decode.prompts


def test_blocks_arriving_on_a_shared_pull_renew_every_child_not_only_the_puller():
    """The siblings of an ``n > 1`` request wait on the puller's transfer of the prompt's full blocks: its progress
    is theirs, or they time out in TRANSFERRING while the pull moves."""
    pair = Pair()
    keys, shared, entries = children_in_transfer(pair, prompt_tokens=40, max_tokens=4, stuck=True)
    assert shared.puller == keys[0]
    received = iter(range(1, 100))
    pair.transfers.poll = lambda h, real=pair.transfers.poll: (IN_PROGRESS, next(received)) if h == shared.pull \
        else real(h)   # the siblings' own partial pulls report nothing
    for _ in range(2):
        pair.clock.advance(2.0)
        pair.decode_step()
        assert [pair.table.rows[k[0]]["last_progress_ns"] for k in keys] == [pair.clock()] * 3
        assert all(pair.table.state(k) == S.TRANSFERRING for k in keys)


def test_every_child_leaving_mid_pull_stops_the_pull_and_frees_every_block_once():
    pair = Pair()
    keys, shared, _ = children_in_transfer(pair, prompt_tokens=40, max_tokens=20, stuck=True)
    for key in reversed(keys):   # the puller last: it holds the pull's blocks to the end
        assert pair.table.transition(*key, S.ABORTED)
        pair.decode_step()
    assert set(pair.transfers.released) == set(pair.transfers.started)   # the shared pull and the 2 partial ones
    assert not pair.decode.prompts and not pair.tokens
    pair.run(2)
    pair.assert_all_free()


@pytest.mark.parametrize("which", ["shared", "partial"])
def test_a_failed_shared_pull_fails_every_child_and_a_failed_partial_pull_only_its_own(which):
    pair = Pair()
    keys, shared, entries = children_in_transfer(pair, prompt_tokens=40, max_tokens=2, stuck=True)
    failing = shared.pull if which == "shared" else entries[1].transfer_handle
    pair.transfers.by_handle[failing] = FAILED
    del pair.transfers.script["kids"]
    pair.run(4)
    failed = keys if which == "shared" else [keys[1]]
    assert sorted((e.slot, e.generation) for e in pair.errors) == sorted(failed)
    assert all(e.http_status == 503 and "stage transfer" in e.message for e in pair.errors)
    assert [pair.table.state(k) for k in keys] == [S.FAILED if k in failed else S.FINISHED for k in keys]
    pair.assert_all_free()
    assert not pair.decode.prompts


@pytest.mark.parametrize("when", ["mid-pull", "decoding"])
def test_stopping_the_actors_frees_shared_prompt_blocks_exactly_once(when):
    pair = Pair()
    keys, shared, _ = children_in_transfer(pair, prompt_tokens=40, max_tokens=20, stuck=when == "mid-pull")
    if when == "decoding":
        pair.decode_step()
        assert all(pair.table.state(k) == S.DECODING for k in keys) and shared.done
    pair.prefill.stop()
    pair.decode.stop()   # FakeAllocator.free raises on a block freed twice or by a slot not holding it
    assert not pair.decode.prompts
    pair.assert_all_free()


@pytest.mark.parametrize("sibling", ["holding", "gone"])
def test_a_child_reserved_late_joins_its_siblings_blocks_or_pulls_the_prompt_again_once_they_left(sibling):
    """The decode pool is full when the second child's KVReady comes: it waits in BOOTSTRAP. If its sibling still
    holds the prompt's blocks it reserves and pulls only its own; if the sibling finished, the prompt's blocks were
    freed and it pulls the whole prompt again (prefill holds it until every child's TransferDone)."""
    pair = Pair(decode_blocks=8)
    holding = sibling == "holding"
    blocker = prefill_request(pair.table, "blocker", prompt_tokens=40, max_tokens=4 if holding else 30)
    pair.prefill.on_message(blocker)   # 3 blocks, done before the first child (or 5, done after it)
    pair.run(1)
    request = prefill_request(pair.table, "kids", prompt_tokens=40, max_tokens=30 if holding else 3, n=2)
    keys = [(request.slot, request.generation), tuple(request.children[0])]
    pair.prefill.on_message(request)
    pair.run(1)   # first child: 2 shared + 3 (or 1) own blocks; the pool is full
    assert [pair.table.state(k) for k in keys] == [S.DECODING, S.BOOTSTRAP] and pair.decode_pool.num_free == 0
    src = pair.prefill.inflight[keys[1]].blocks
    pair.run(3)
    assert pair.table.state(keys[1]) in (S.DECODING, S.FINISHED)
    [(_, pulled, _, _)] = [s for s in pair.transfers.started.values() if s[0] == "kids"][1:]
    assert pulled == (src[2:] if holding else src)
    pair.run(30)
    assert all(pair.table.state(k) == S.FINISHED for k in keys)
    pair.assert_all_free()


def test_a_later_request_on_the_same_prefill_blocks_and_request_id_does_not_share_an_earlier_ones_prompt():
    """The key is the request's first row (slot, generation), not its id (a client may reuse an X-Request-Id) nor
    its source blocks (freed by prefill once decode holds a copy, then given to the next prompt)."""
    pair = Pair()
    first = prefill_request(pair.table, "same-id", prompt_tokens=40, max_tokens=20, n=2)
    pair.prefill.on_message(first)
    pair.run(2)
    assert pair.prefill_pool.num_free == 32   # both children hold their copy: prefill freed the source blocks
    [earlier] = pair.decode.prompts.values()
    second = prefill_request(pair.table, "same-id", prompt_tokens=40, max_tokens=20)
    pair.prefill.on_message(second)
    pair.prefill_step()
    [ready] = pair.deliver_to_decode()
    assert (ready.request_id, ready.src_block_ids) == ("same-id", pair.transfers.started[1][1])   # what collides
    pair.decode_step()
    assert len(pair.decode.prompts) == 2 and earlier.holders == {(first.slot, first.generation),
                                                                 tuple(first.children[0])}
    later = pair.transfers.started[max(pair.transfers.started)]
    assert later[1] == ready.src_block_ids and not set(later[2]) & set(earlier.blocks)   # a full pull of its own
    pair.run(24)
    pair.assert_all_free()


@pytest.mark.parametrize("via", ["reject", "decode_reject fault"])
def test_a_kv_ready_refused_at_intake_fails_its_row_once_and_holds_nothing(via):
    from actors.fault_ports import accept_kv_ready
    from pdserve.faults import FaultPlan

    pair = Pair()
    request = prefill_request(pair.table, "refused-1")
    key = (request.slot, request.generation)
    pair.prefill.on_message(request)
    pair.prefill_step()
    [ready] = pair.to_decode.take(LOCAL_DECODE)
    if via == "reject":
        assert pair.decode.reject(ready, 502, "bad_gateway", "unusable peer")
    else:
        assert not accept_kv_ready(FaultPlan("decode_reject:match=refused-", "decode0"), ready, pair.decode)
    assert pair.table.state(key) == S.FAILED and pair.table.rows[key[0]]["owner"] == DECODE
    [error] = pair.to_prefill_and_api.take("api", RequestError)
    assert (error.slot, error.generation) == key
    assert error.http_status == (502 if via == "reject" else 503)
    assert not pair.decode.reject(ready, 502, "bad_gateway", "again")   # an ended row: nothing sent twice
    assert pair.to_prefill_and_api.sent == []
    assert pair.decode_pool.num_free == pair.decode_pool.num_blocks and not pair.decode.bootstrap
    pair.run(2)   # prefill sees the row final and frees its blocks
    pair.assert_all_free()


def test_an_answer_without_max_tokens_takes_a_block_at_a_time_and_ends_with_length_when_the_pool_is_full():
    pair = Pair(decode_blocks=4)   # 64 tokens
    # no max_tokens: the rest of a large context, of which 4 tokens are reserved up front (api/protocol.py)
    request = prefill_request(pair.table, "grow", prompt_tokens=20, max_tokens=1000, reserve_tokens=4)
    key = (request.slot, request.generation)
    pair.prefill.on_message(request)
    pair.run(2)
    assert pair.table.state(key) == S.DECODING and pair.decode_pool.num_free == 2   # ceil((20 + 4) / 16)
    pair.run(35)
    assert pair.decode_pool.num_free == 0 and pair.table.rows[request.slot]["decode_blocks"] == 4
    pair.run(40)
    assert pair.table.state(key) == S.FINISHED
    ours = [t for t in pair.tokens if (t[0], t[1]) == key]
    # positions 20..63 hold the prompt's last 44 tokens' KV; the 45th token has no block to go to
    assert len(ours) == 64 - 20 + 1 and ours[-1][3] == "length" and all(t[3] is None for t in ours[:-1])
    pair.assert_all_free()


def test_a_request_with_max_tokens_reserves_all_of_it_up_front_and_never_grows():
    pair = Pair(decode_blocks=8)
    request = prefill_request(pair.table, "fixed", prompt_tokens=20, max_tokens=30)
    pair.prefill.on_message(request)
    pair.run(2)
    assert pair.decode_pool.num_free == 8 - 4   # ceil((20 + 30) / 16)
    pair.run(40)
    assert [t[3] for t in pair.tokens][-1] == "length" and len(pair.tokens) == 30
    pair.assert_all_free()


# ---- cross-turn reuse: decode hands a finished request's KV back to prefill's prefix cache ----------------------
class HandBackPair(Pair):
    """A Pair whose decode core hands finished requests back (``hand_back``) to prefill actor PREFILL, which copies
    what its cache lacks through ``copy`` (checking the source blocks' generations in the decode pool as the
    shell's copy does; ``copies`` records each) and copies cached rows inside its pool (``rows_copied``)."""

    def __init__(self, prefill_blocks: int = 32, decode_blocks: int = 32, **kw):
        super().__init__(prefill_blocks, decode_blocks, prefix_cache=True, **kw)
        self.copies: list[tuple[list, list]] = []
        self.rows_copied: list[tuple] = []
        self.cache = CachingAllocator(self.prefill_pool, copy_rows=lambda s, d, r: self.rows_copied.append((s, d, r)))
        self.prefill = PrefillCore(self.table, self.cache, self.to_decode, self.clock, actor_index=PREFILL,
                                   on_late=self._late, handoff_from=PREFILL_AT, hand_back_copy=self.copy)
        self.decode = DecodeCore(self.table, self.decode_pool, self.transfers, self.to_prefill_and_api, self.clock,
                                 actor_index=DECODE, eos_ids=[EOS], max_num_seqs=8, block_bytes=100,
                                 hand_back=True, linger_s=2.0, address=DECODE_AT)

    def copy(self, decode_actor, src, generations, dst) -> bool:
        assert decode_actor == DECODE_AT
        if (self.decode_pool.generations(src) != generations
                or any(self.decode_pool.owner[b] != HANDBACK_OWNER for b in src)):
            return False
        self.copies.append((list(src), list(dst)))
        return True

    def deliver_to_decode(self) -> list:
        messages = self.to_decode.take(LOCAL_DECODE) + self.to_decode.take(DECODE_AT)
        for message in messages:
            self.decode.on_message(message)
        return messages

    def deliver_to_prefill(self) -> list:
        messages = self.to_prefill_and_api.take(PREFILL_AT)
        for message in messages:
            self.prefill.on_message(message)
        return messages

    def turn(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> tuple:
        """Serve one request to the end; returns its key and the work that prefilled it."""
        request = prefill_request(self.table, request_id, prompt_tokens=len(prompt_ids), max_tokens=max_tokens)
        request = dataclasses.replace(request, prompt_ids=list(prompt_ids))
        self.prefill.on_message(request)
        work = prefill_one(self.prefill)
        self.prefill.finish(work, [(5, None)])
        self.run(max_tokens + 2)
        return (request.slot, request.generation), work


def test_a_finished_answer_is_handed_back_and_the_next_turn_hits_it_to_the_token():
    pair = HandBackPair()
    prompt = list(range(1, 21))
    key, _ = pair.turn("turn1", prompt, max_tokens=20)   # answer 5, 7 x 19: KV of 20 + 19 tokens in 3 blocks
    assert pair.table.state(key) == S.FINISHED
    # prompt block 0 was cached at prefill: copied are block 1 (full) and the partial block 2 (7 tokens)
    assert [len(src) for src, _ in pair.copies] == [2] and pair.cache.adopted_blocks == 2
    assert pair.decode.hand_backs_dropped == pair.prefill.hand_backs_dropped == 0
    pair.assert_all_free()   # decode freed its blocks on HandBackDone; the cache holds no reference
    answer = [5] + [7] * 19
    _, work = pair.turn("turn2", prompt + answer + [100, 101], max_tokens=1)
    assert work.cached_tokens == 20 + 19   # every token with KV: the whole first turn but its last token
    assert pair.rows_copied[-1][2] == 39 - 32
    pair.assert_all_free()


@pytest.mark.parametrize("end", ["abort", "timeout", "stop-actor"])
def test_a_request_ended_mid_decode_hands_nothing_back_and_holds_nothing(end):
    pair = HandBackPair()
    request = prefill_request(pair.table, "r", prompt_tokens=40, max_tokens=30)
    key = (request.slot, request.generation)
    pair.prefill.on_message(request)
    pair.run(5)
    assert pair.table.state(key) == S.DECODING
    if end == "stop-actor":
        pair.decode.stop()
        pair.prefill.stop()
        assert pair.table.transition(*key, S.FAILED)   # the supervisor fails the rows of a restarted actor
    else:
        assert pair.table.transition(*key, S.ABORTED if end == "abort" else S.TIMED_OUT)
    pair.run(3)
    assert not pair.to_prefill_and_api.take(PREFILL_AT, KVHandBack) and not pair.copies
    assert pair.cache.adopted_blocks == 0 and not pair.decode.lingering
    pair.assert_all_free()


def test_an_n_2_request_whose_second_child_finishes_last_hands_nothing_back_and_frees_everything():
    """The prompt blocks of an ``n > 1`` request are owned by its first child; when a sibling is the last holder,
    a hand-back would hand over blocks that sibling does not own (the decode actor died on it: KVBlockStateError)."""
    pair = HandBackPair()
    request = prefill_request(pair.table, "n2", prompt_tokens=40, max_tokens=12, n=2)
    first = (request.slot, request.generation)
    pair.prefill.on_message(request)
    pair.run(4)
    assert pair.table.state(first) == S.DECODING
    abort(pair, first)   # the first child (the prompt blocks' owner) leaves early; its sibling runs to the end
    pair.run(16)
    second = tuple(request.children[0])
    assert pair.table.state(second) == S.FINISHED
    assert not pair.to_prefill_and_api.take(PREFILL_AT, KVHandBack) and not pair.copies
    pair.assert_all_free()


def test_a_hand_back_whose_blocks_were_reallocated_meanwhile_is_dropped_and_counted():
    pair = HandBackPair(decode_blocks=4)
    request = prefill_request(pair.table, "a", prompt_tokens=20, max_tokens=20)
    pair.prefill.on_message(request)
    pair.run(25)   # ... but hold its hand-back back from prefill: it sits in prefill's queue
    held = [m for d, m in pair.to_prefill_and_api.sent if isinstance(m, KVHandBack)]
    assert held == [] and pair.cache.adopted_blocks == 2   # run() delivered the first; serve another, held back
    b = prefill_request(pair.table, "b", prompt_tokens=20, max_tokens=20)
    pair.prefill.on_message(dataclasses.replace(b, prompt_ids=[t + 500 for t in b.prompt_ids]))
    pair.prefill.finish(prefill_one(pair.prefill), [(5, None)])
    pair.deliver_to_decode()
    for _ in range(25):
        pair.decode_step()
    [held] = pair.to_prefill_and_api.take(PREFILL_AT, KVHandBack)
    assert pair.decode.lingering and pair.table.state((b.slot, b.generation)) == S.FINISHED
    pair.clock.now_ns += 3 * 10**9   # linger_s passes without HandBackDone: decode frees the blocks ...
    c = prefill_request(pair.table, "c", prompt_tokens=40, max_tokens=20)   # ... and c's reservation takes them
    pair.prefill.on_message(c)
    pair.prefill.finish(prefill_one(pair.prefill), [(5, None)])
    pair.deliver_to_decode()
    pair.decode_step()
    assert not pair.decode.lingering and set(held.block_ids) & set(pair.decode.decoding[0].blocks)
    cached = pair.cache.cached_blocks
    pair.prefill.on_message(held)   # the late hand-back: its blocks hold c's KV now
    assert pair.prefill.hand_backs_dropped == 1 and pair.cache.cached_blocks == cached
    assert pair.to_decode.take(DECODE_AT, HandBackDone) == [HandBackDone(held.slot, held.generation)]
    pair.run(30)
    pair.assert_all_free()


def test_a_hand_back_to_a_restarted_prefill_actor_is_dropped_and_decode_still_frees_its_blocks():
    pair = HandBackPair()
    request = prefill_request(pair.table, "r", prompt_tokens=20, max_tokens=20)
    pair.prefill.on_message(request)
    pair.prefill.finish(prefill_one(pair.prefill), [(5, None)])
    pair.deliver_to_decode()
    for _ in range(4):
        pair.decode_step()
        pair.deliver_to_prefill()   # TransferDone
    for _ in range(25):
        pair.decode_step()
    [hand_back] = pair.to_prefill_and_api.take(PREFILL_AT, KVHandBack)
    pair.prefill.stop()   # the prefill actor restarts: a new core, a new (empty) cache
    pair.cache = CachingAllocator(pair.prefill_pool, copy_rows=lambda s, d, r: None)
    pair.cache.clear()
    pair.prefill = PrefillCore(pair.table, pair.cache, pair.to_decode, pair.clock, actor_index=PREFILL,
                               handoff_from=PREFILL_AT, hand_back_copy=pair.copy)
    pair.prefill.on_message(hand_back)
    assert pair.prefill.hand_backs_dropped == 1 and not pair.copies and pair.cache.cached_blocks == 0
    assert pair.deliver_to_decode() == [HandBackDone(*hand_back_key(hand_back))]
    assert not pair.decode.lingering and pair.decode_pool.num_free == 32


def hand_back_key(message: KVHandBack) -> tuple[int, int]:
    return message.slot, message.generation


def test_a_full_prefill_queue_drops_the_hand_back_at_once_and_a_short_pool_takes_lingering_blocks():
    pair = HandBackPair(decode_blocks=4)
    sent_nowait = pair.to_prefill_and_api.try_send
    pair.to_prefill_and_api.try_send = lambda *args, **kwargs: False   # prefill's queue has no free slot now
    pair.prefill.on_message(prefill_request(pair.table, "r", prompt_tokens=20, max_tokens=20))
    pair.run(25)
    assert pair.decode.hand_backs_dropped == 1 and not pair.decode.lingering and pair.cache.adopted_blocks == 0
    pair.assert_all_free()
    # a hand-back that lingers (its HandBackDone is lost), then a reservation the pool is short for without it
    pair.to_prefill_and_api.try_send = sent_nowait
    second = prefill_request(pair.table, "s", prompt_tokens=20, max_tokens=20)
    pair.prefill.on_message(second)
    pair.prefill.finish(prefill_one(pair.prefill), [(5, None)])
    pair.deliver_to_decode()
    for _ in range(25):
        pair.decode_step()
    assert pair.table.state((second.slot, second.generation)) == S.FINISHED
    assert pair.decode.lingering and pair.decode_pool.num_free == 1
    third = prefill_request(pair.table, "t", prompt_tokens=40, max_tokens=8)   # needs 3 blocks
    pair.prefill.on_message(third)
    pair.prefill.finish(prefill_one(pair.prefill), [(5, None)])
    pair.deliver_to_decode()
    pair.decode_step()
    assert not pair.decode.lingering and pair.table.state((third.slot, third.generation)) == S.DECODING


def test_colocated_mode_hands_the_finished_blocks_over_to_the_cache_without_a_copy():
    clock = FakeClock()
    table = FakeTable(clock)
    base = FakeAllocator(16)
    pool = CachingAllocator(base, copy_rows=lambda s, d, r: None)
    outbox = QueueOutbox({"api": type("ApiQueue", (), {"put": lambda self, frame, timeout_s: None})()}, 1.0)
    prefill = PrefillCore(table, pool, outbox, clock, actor_index=DECODE)
    decode = DecodeCore(table, pool, FakeTransfers(local=True), outbox, clock, actor_index=DECODE, eos_ids=[EOS],
                        max_num_seqs=4, block_bytes=100, hand_back=True)
    outbox.add_local(LOCAL_PREFILL, prefill)
    outbox.add_local(LOCAL_DECODE, decode)

    def serve(request_id: str, prompt: list[int], max_tokens: int):
        request = prefill_request(table, request_id, prompt_tokens=len(prompt), max_tokens=max_tokens)
        prefill.on_message(dataclasses.replace(request, prompt_ids=prompt))
        work = prefill_one(prefill)
        prefill.finish(work, [(5, None)])
        decode.start_transfers()
        decode.poll_transfers()
        decode.join_batch()
        while decode.batch():
            decode.step_done(decode.batch(), [7] * len(decode.batch()), [None] * len(decode.batch()))
        decode.flush()
        return work

    prompt = list(range(1, 21))
    serve("turn1", prompt, max_tokens=20)   # 39 tokens with KV: decode's blocks 1 and 2 join the cache in place
    assert pool.adopted_blocks == 2 and not decode.lingering and pool.cached_blocks_in_use == 0
    assert base.num_free == 16 - pool.cached_blocks and pool.num_free == 16
    work = serve("turn2", prompt + [5] + [7] * 19 + [100], max_tokens=1)
    assert work.cached_tokens == 39 and pool.num_free == 16


# ---- embeddings: QUEUED -> PREFILLING -> FINISHED, through the prefill core alone --------------------------------
def embed_request(table: FakeTable, request_id: str, prompt_tokens: int = 20, pooling: str = "last") -> EmbedRequest:
    slot, generation = table.allocate(request_id, prompt_tokens)
    return EmbedRequest(slot, generation, request_id, list(range(1, prompt_tokens + 1)), pooling)


def test_an_embedding_is_prefilled_then_finished_by_prefill_with_nothing_sent_to_decode():
    pair = batching_pair(batch_tokens=64, chunk_tokens=16)
    request = embed_request(pair.table, "e1", prompt_tokens=40, pooling="mean")
    key = (request.slot, request.generation)
    pair.prefill.on_message(request)
    passes = []
    while not passes or not done:   # a chunk per pass, each renewing the row's PREFILLING deadline
        chunks = pair.prefill.next_batch()
        assert chunks[0].work.embedding and pair.table.state(key) == S.PREFILLING
        assert pair.prefill.own_gauges() == {"queued": 0, "prefill_inflight": 0, "running": 1}
        pair.clock.advance(1.0)
        done = pair.prefill.batch_done(chunks)
        assert pair.table.rows[key[0]]["last_progress_ns"] == pair.clock.now_ns
        passes.append(spans(chunks))
    assert passes == [[("e1", 0, 16)], [("e1", 16, 32)], [("e1", 32, 40)]]
    assert pair.prefill_pool.num_free == 32 - 3 and pair.table.rows[key[0]]["prefill_blocks"] == 3
    [work] = done
    pair.prefill.finish_embedding(work, "AACAPw==")
    assert pair.table.state(key) == S.FINISHED
    assert pair.to_decode.take("api") == [Embedding(*key, "AACAPw==")]
    assert pair.to_decode.sent == [] and pair.prefill.handed_off == 1
    assert pair.prefill.own_gauges() == {"queued": 0, "prefill_inflight": 0, "running": 0}
    assert pair.table.rows[key[0]]["prefill_blocks"] == 0
    pair.assert_all_free()


def test_embeddings_are_packed_with_prompts_in_arrival_order_and_each_prompt_goes_on_to_decode():
    pair = batching_pair(batch_tokens=64, chunk_tokens=32)
    pair.prefill.on_message(embed_request(pair.table, "e1", prompt_tokens=10))
    pair.prefill.on_message(prefill_request(pair.table, "p1", prompt_tokens=20))
    pair.prefill.on_message(embed_request(pair.table, "e2", prompt_tokens=12))
    chunks = pair.prefill.next_batch()
    assert spans(chunks) == [("e1", 0, 10), ("p1", 0, 20), ("e2", 0, 12)]
    for work in pair.prefill.batch_done(chunks):
        if work.embedding:
            pair.prefill.finish_embedding(work, work.request.request_id)
        else:
            pair.prefill.finish(work, [(5, None)])
    assert [m.data for m in pair.to_decode.take("api")] == ["e1", "e2"]
    assert [r.request_id for r in pair.to_decode.take(LOCAL_DECODE)] == ["p1"]


@pytest.mark.parametrize("end", ["aborted while queued", "aborted between chunks", "timed out before its end"])
def test_an_embedding_whose_row_ended_sends_nothing_and_frees_its_blocks_once(end):
    pair = batching_pair(batch_tokens=16, chunk_tokens=16)
    request = embed_request(pair.table, "e1", prompt_tokens=40)
    key = (request.slot, request.generation)
    pair.prefill.on_message(request)
    if end == "aborted while queued":
        abort(pair, key)
        pair.prefill.reap()
        assert pair.prefill.next_batch() == []
    else:
        chunks = pair.prefill.next_batch()
        pair.prefill.batch_done(chunks)
        chunks = pair.prefill.next_batch()
        if end == "aborted between chunks":
            abort(pair, key)
            pair.prefill.reap()
        else:
            pair.prefill.batch_done(chunks)
            [last] = pair.prefill.next_batch()
            [work] = pair.prefill.batch_done([last])
            assert pair.table.transition(*key, S.TIMED_OUT)   # the monitor, while the runner pools it
            pair.prefill.finish_embedding(work, "AAAA")
    assert pair.to_decode.sent == []
    assert pair.prefill.own_gauges() == {"queued": 0, "prefill_inflight": 0, "running": 0}
    pair.assert_all_free()


def test_an_embedding_reads_no_cached_prefix_but_leaves_its_kv_to_the_cache():
    """Every token's hidden state is computed (the same numbers whatever was cached before), and the prompt's KV,
    all of it prefilled, is cached for a later prompt that starts with it."""
    pair = batching_pair(batch_tokens=256, chunk_tokens=256, prefix_cache=True)
    for name in ("e1", "e2"):   # the second finds the first's blocks cached and computes every token anyway
        pair.prefill.on_message(embed_request(pair.table, name, prompt_tokens=40))
        [chunk] = pair.prefill.next_batch()
        assert (chunk.start, chunk.end, chunk.work.cached_tokens) == (0, 40, 0)
        [work] = pair.prefill.batch_done([chunk])
        pair.prefill.finish_embedding(work, "AAAA")
        assert pair.cache.cached_blocks_in_use == 0
    later = prefill_request(pair.table, "p1", prompt_tokens=50)
    pair.prefill.on_message(later)
    [chunk] = pair.prefill.next_batch()
    assert chunk.work.cached_tokens == 32 and chunk.start == 32   # e1's two full blocks


def test_a_watchdog_drills_prompt_neither_reuses_nor_fills_the_prefix_cache():
    """A drill (id prefix drill-, api/drill.py) after the same prompt was cached: no lookup, no hit, nothing cached
    by it; a client's same prompt afterwards still hits the first one's blocks."""
    pair = Pair(prefix_cache=True)
    pair.prefill.on_message(prefill_request(pair.table, "r1", prompt_tokens=40, max_tokens=1))
    pair.run(2)
    cached, queried = pair.cache.cached_blocks, pair.cache.query_tokens
    # the first 32 tokens are the cached prompt's; its third full block would be new to the cache
    pair.prefill.on_message(prefill_request(pair.table, "drill-transfer-1", prompt_tokens=56, max_tokens=1))
    work = prefill_one(pair.prefill)
    assert work.cached_tokens == 0 and work.uncached
    pair.prefill.finish(work, [(5, None)])
    assert (pair.cache.cached_blocks, pair.cache.query_tokens) == (cached, queried)
    pair.run(2)
    pair.assert_all_free()
    assert pair.cache.cached_blocks == cached
