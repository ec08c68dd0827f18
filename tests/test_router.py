"""The router across engines (rlhf_sg.serve.router): stickiness, least-loaded placement and its tie-break, release,
idle expiry, round robin, consistent hashing, counters, and the --rollout.routing flag."""

from __future__ import annotations

import threading

import pytest

from rlhf_sg.serve.router import ROUTING_POLICIES, Router


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_session_stays_on_its_engine():
    r = Router(3)
    first = r.acquire("a", 10)
    r.acquire("b", 10)
    r.acquire("c", 10)
    for _ in range(5):
        with r.call("a", 50) as engine:
            assert engine == first


def test_new_sessions_go_to_the_engine_with_fewest_sessions_then_tokens():
    r = Router(3)
    placed = [r.acquire(s, 100) for s in ("a", "b", "c")]
    assert sorted(placed) == [0, 1, 2]
    r.release("b")  # its engine has no session now (its call still counts tokens)
    assert r.acquire("d", 1) == placed[1]
    # equal sessions everywhere: the engine with the fewest outstanding tokens
    r.finish("a", placed[0], 100)
    assert r.acquire("e", 1) == placed[0]


def test_fewer_sessions_wins_over_fewer_tokens():
    r = Router(2)
    assert r.acquire("long", 1000) == 0
    assert r.acquire("short1", 10) == 1
    assert r.acquire("short2", 10) == 1  # one session each: the fewer tokens
    assert r.acquire("next", 10) == 0  # engine 1 has more sessions, though fewer tokens


def test_ties_go_to_the_engine_chosen_least_recently_not_the_lowest_index():
    r = Router(4)
    # sessions that start and end while every engine is idle must not all land on engine 0
    seen = []
    for k in range(8):
        with r.call(f"s{k}", 10) as engine:
            seen.append(engine)
        r.release(f"s{k}")
    assert seen == [0, 1, 2, 3, 0, 1, 2, 3]


def test_release_frees_the_session_and_its_engine_count():
    r = Router(2)
    e = r.acquire("a", 10)
    r.finish("a", e, 10)
    assert r.engines[e].sessions == 1 and r.engine_of("a") == e
    r.release("a")
    assert r.engines[e].sessions == 0 and r.engine_of("a") is None
    r.release("a")  # twice: nothing
    assert r.engines[e].sessions == 0


def test_idle_sessions_expire_but_never_with_a_call_in_flight():
    clock = Clock()
    r = Router(2, idle_expiry_s=10, clock=clock)
    ea = r.acquire("a", 10)
    r.finish("a", ea, 10)
    eb = r.acquire("b", 10)  # stays in flight
    clock.t = 11
    r.acquire("c", 1)  # any call sweeps
    assert r.engine_of("a") is None and r.engine_of("b") == eb
    assert r.expired == 1 and r.engines[ea].sessions == (1 if r.engine_of("c") == ea else 0)
    clock.t = 15
    r.finish("b", eb, 10)
    clock.t = 24  # b was last used at 15: fresh
    r.acquire("c", 1)
    assert r.engine_of("b") == eb


def test_round_robin_moves_every_call_and_ignores_sessions():
    r = Router(3, "round_robin")
    engines = []
    for _ in range(6):
        with r.call("a", 10) as e:
            engines.append(e)
    assert engines == [0, 1, 2, 0, 1, 2]
    assert sum(x.sessions for x in r.engines) == 1


def test_consistent_hash_is_sticky_spread_and_blind_to_load():
    r = Router(4, "consistent_hash")
    placed = {f"s{k}": r.acquire(f"s{k}", 10) for k in range(400)}
    counts = [list(placed.values()).count(e) for e in range(4)]
    assert min(counts) > 50, counts  # spread over every engine
    again = Router(4, "consistent_hash")
    assert all(again.acquire(s, 10) == e for s, e in placed.items())  # the same ring in every router
    hot = placed["s0"]
    for k in range(50):  # load piles onto one engine: the hash does not care
        if again.acquire(f"s0/{k}", 1) == hot:
            r.acquire(f"s0/{k}", 10**6)
    assert r.engines[hot].tokens > max(x.tokens for i, x in enumerate(r.engines) if i != hot)
    r.release("s0")
    assert r.acquire("s0", 10) == hot


def test_counters_track_calls_tokens_and_cache_hits():
    r = Router(2)
    e = r.acquire("a", 30)
    assert (r.engines[e].calls, r.engines[e].tokens) == (1, 30)
    with pytest.raises(RuntimeError), r.call("a", 20):
        assert r.engines[e].tokens == 50
        raise RuntimeError("the call failed")
    assert (r.engines[e].calls, r.engines[e].tokens) == (1, 30)  # a failed call is finished too
    r.record_cache(e, 100, 90)
    r.record_cache(e, 100, None)  # the engine does not say: not counted
    m = r.metrics()
    assert m["routing/prefix_cache_hit"] == pytest.approx(0.9)
    assert m[f"routing/engine{e}/sessions"] == 1 and m[f"routing/engine{e}/tokens"] == 30


def test_concurrent_calls_keep_the_counters_whole():
    r = Router(4)

    def work(k):
        for t in range(200):
            with r.call(f"s{k % 16}", t):
                pass

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(e.calls == 0 and e.tokens == 0 for e in r.engines)
    assert sum(e.sessions for e in r.engines) == 8


def test_bad_arguments():
    with pytest.raises(ValueError, match="consistent_hash"):
        Router(2, "least_busy")
    with pytest.raises(ValueError, match="num_engines"):
        Router(0)
    assert set(ROUTING_POLICIES) == {"sticky_least_loaded", "round_robin", "consistent_hash"}
