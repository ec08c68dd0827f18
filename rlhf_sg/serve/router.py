"""Which engine serves a call: sessions across a run's engines (``--rollout.routing``).

A *session* is one trajectory (or one group of samples sharing a prompt): its turns extend one another, so the
engine that served its earlier turns holds their KV in its prefix cache. Policies:

* ``sticky_least_loaded`` (default): a known session stays on its engine; a new one goes to the engine with the
  fewest active sessions, then the fewest outstanding tokens, ties broken by the engine chosen least recently
  (never by index alone: sessions that start while every engine is idle would all land on engine 0).
* ``round_robin``: every call to the next engine in turn, sessions ignored (the baseline that loses the cache).
* ``consistent_hash``: a session's id hashed onto a ring of virtual nodes; sticky, but blind to load (one hot
  engine keeps its sessions however long its queue grows).

Sessions end by :meth:`Router.release` (the trajectory is done) or expire after ``idle_expiry_s`` without a call
(a harness that never says it is done); a session with a call in flight never expires. Per engine the router
counts active sessions, calls and tokens in flight, and the prompt tokens sent and served from the prefix cache
(:meth:`Router.record_cache`), logged as ``routing/*`` (:meth:`Router.metrics`).

Only the data plane goes through a router: weight sync, pause, abort and flush go to every engine directly.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["ROUTING_POLICIES", "EngineLoad", "Router"]

ROUTING_POLICIES = ("sticky_least_loaded", "round_robin", "consistent_hash")
#: virtual nodes per engine on the consistent-hash ring (spreads sessions evenly over a few engines)
_RING_REPLICAS = 64


@dataclass
class EngineLoad:
    """One engine's counters. ``sessions``: active sessions placed on it; ``calls`` / ``tokens``: calls and their
    tokens (prompt + the most it may sample) in flight; ``chosen``: sessions (or, round-robin, calls) placed;
    ``prompt_tokens`` / ``cached_tokens``: prompt tokens sent and served from its prefix cache."""

    sessions: int = 0
    calls: int = 0
    tokens: int = 0
    chosen: int = 0
    last_chosen: int = -1  # the router's tick when last chosen (-1: never)
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class _Session:
    engine: int
    calls: int = 0  # in flight
    last_used: float = 0.0


def _hash64(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


class Router:
    """Places sessions on ``num_engines`` engines by ``policy`` (:data:`ROUTING_POLICIES`); thread-safe.

    ``clock``: seconds, monotonic (tests pass their own)."""

    def __init__(self, num_engines: int, policy: str = "sticky_least_loaded", idle_expiry_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy {policy!r} unknown; choose one of {list(ROUTING_POLICIES)}")
        if num_engines < 1:
            raise ValueError(f"Router: num_engines must be >= 1, got {num_engines}")
        if idle_expiry_s <= 0:
            raise ValueError(f"Router: idle_expiry_s must be > 0, got {idle_expiry_s}")
        self.policy, self.num_engines, self.idle_expiry_s, self._clock = policy, num_engines, idle_expiry_s, clock
        self.engines = [EngineLoad() for _ in range(num_engines)]
        self._sessions: collections.OrderedDict[str, _Session] = collections.OrderedDict()  # least recent first
        self._lock = threading.Lock()
        self._tick = 0
        self._next = 0  # round robin's next engine
        self.expired = 0
        if policy == "consistent_hash":
            points = sorted((_hash64(f"engine-{e}/{r}"), e) for e in range(num_engines) for r in range(_RING_REPLICAS))
            self._ring_keys = [p for p, _ in points]
            self._ring_engines = [e for _, e in points]

    # ---- the data plane ------------------------------------------------------------------------------------
    def acquire(self, session: str, tokens: int) -> int:
        """The engine for one call of ``session`` that may hold ``tokens`` tokens (prompt + room to sample);
        counts the call in flight until :meth:`finish`."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            s = self._sessions.get(session)
            if s is None:
                s = _Session(self._place(session))
                self._sessions[session] = s
                self.engines[s.engine].sessions += 1
            elif self.policy == "round_robin":  # every call moves on; the session's count moves with it
                self.engines[s.engine].sessions -= 1
                s.engine = self._pick_round_robin()
                self.engines[s.engine].sessions += 1
            s.calls += 1
            s.last_used = now
            self._sessions.move_to_end(session)
            load = self.engines[s.engine]
            load.calls += 1
            load.tokens += int(tokens)
            return s.engine

    def finish(self, session: str, engine: int, tokens: int) -> None:
        """The call :meth:`acquire` placed on ``engine`` with ``tokens`` is done (answered, failed or aborted)."""
        with self._lock:
            load = self.engines[engine]
            load.calls -= 1
            load.tokens -= int(tokens)
            s = self._sessions.get(session)
            if s is not None:
                s.calls -= 1
                s.last_used = self._clock()
                self._sessions.move_to_end(session)

    @contextlib.contextmanager
    def call(self, session: str, tokens: int) -> Iterator[int]:
        """``with router.call(session, tokens) as engine:`` acquire, then finish however the block ends."""
        engine = self.acquire(session, tokens)
        try:
            yield engine
        finally:
            self.finish(session, engine, tokens)

    def release(self, session: str) -> None:
        """The session is done: its engine loses it (an unknown or already released session: nothing)."""
        with self._lock:
            s = self._sessions.pop(session, None)
            if s is not None:
                self.engines[s.engine].sessions -= 1

    def engine_of(self, session: str) -> int | None:
        """The engine a live session is on (None: unknown, released or expired)."""
        with self._lock:
            s = self._sessions.get(session)
            return None if s is None else s.engine

    def record_cache(self, engine: int, prompt_tokens: int, cached_tokens: int | None) -> None:
        """An engine's answer said how many of a call's ``prompt_tokens`` came from its prefix cache (None: the
        engine does not say; not counted)."""
        if cached_tokens is None:
            return
        with self._lock:
            self.engines[engine].prompt_tokens += int(prompt_tokens)
            self.engines[engine].cached_tokens += int(cached_tokens)

    def metrics(self, prefix: str = "routing/") -> dict[str, float]:
        """Per-engine counters (``routing/engine{i}/sessions`` ...) and the prefix-cache hit fraction over the
        engines that report it."""
        with self._lock:
            out: dict[str, float] = {f"{prefix}active_sessions": float(len(self._sessions)),
                                     f"{prefix}expired_sessions": float(self.expired)}
            for i, e in enumerate(self.engines):
                for key in ("sessions", "calls", "tokens", "chosen"):
                    out[f"{prefix}engine{i}/{key}"] = float(getattr(e, key))
            sent = sum(e.prompt_tokens for e in self.engines)
            if sent:
                out[f"{prefix}prefix_cache_hit"] = sum(e.cached_tokens for e in self.engines) / sent
            return out

    # ---- placement (under the lock) --------------------------------------------------------------------------
    def _place(self, session: str) -> int:
        if self.policy == "round_robin":
            return self._pick_round_robin()
        if self.policy == "consistent_hash":
            i = bisect.bisect(self._ring_keys, _hash64(session)) % len(self._ring_keys)
            engine = self._ring_engines[i]
        else:
            engine = min(range(self.num_engines),
                         key=lambda e: (self.engines[e].sessions, self.engines[e].tokens, self.engines[e].last_chosen))
        self._chose(engine)
        return engine

    def _pick_round_robin(self) -> int:
        engine = self._next
        self._next = (self._next + 1) % self.num_engines
        self._chose(engine)
        return engine

    def _chose(self, engine: int) -> None:
        self._tick += 1
        self.engines[engine].chosen += 1
        self.engines[engine].last_chosen = self._tick

    def _expire(self, now: float) -> None:
        """Drop sessions idle past ``idle_expiry_s`` with no call in flight: the least recently used come first, so
        the scan stops at the first one still fresh."""
        stale = []
        for k, s in self._sessions.items():
            if now - s.last_used <= self.idle_expiry_s:
                break
            if s.calls == 0:
                stale.append(k)
        for k in stale:
            self.engines[self._sessions.pop(k).engine].sessions -= 1
            self.expired += 1
