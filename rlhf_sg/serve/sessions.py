"""Sessions of the endpoint: one API key each, the calls they made, token-exact, and the samples those calls form.

A session is opened by the trainer for one harness run (one prompt's sample) with a token budget and a time to
live; its key is the harness's API key. Every call records the exact ids the engine prefilled, the ids it sampled,
their log-probs, the weight version and the finish reason (:class:`CallRecord`). Calls become samples by token-id
prefix (:meth:`Session.tie`): a call whose prompt extends a sample's ids so far (its first prompt, every completion
and the observations between) continues that sample, the ids between its last completion and the new prompt
becoming an observation (mask 0); any other call starts a new sample (a fork: a harness that edited its history, a
template that dropped past reasoning). Nothing is asserted and nothing is re-tokenised; both outcomes are counted.
An auxiliary call (a title, a summary: :meth:`Session.record_auxiliary`) is recorded and spends the budget but
joins no sample, so it never becomes training data.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CallRecord", "Sample", "Session", "SessionStore"]


@dataclass
class CallRecord:
    """One engine call: prompt_ids (what the engine prefilled), completion_ids, logprobs (one per completion id,
    the engine's), weight_version, finish_reason, the engine it ran on, the sample it joined (-1: none, an
    auxiliary call) and the tool calls parsed from it; ``messages`` is what the harness sent (for the next call's
    continuation); ``kind`` chat or completion."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: str
    engine: int
    sample: int = -1
    continued: bool = False
    tool_calls: int = 0
    tool_parse_errors: int = 0
    kind: str = "chat"
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    reply: dict[str, Any] | None = None  # the assistant message the harness was sent
    auxiliary: bool = False  # served, recorded, left out of every sample


@dataclass
class Sample:
    """One trajectory made of calls: ``prompt_ids`` (the first call's prompt), then the response block:
    ``token_ids`` (completions, mask 1, and the observations between them, mask 0), ``logprobs`` (0.0 on
    observations), ``action_mask``, the weight version of each call."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    action_mask: list[bool] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    calls: int = 0

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids


@dataclass
class Session:
    """One harness run's session. ``budget_tokens``: completion tokens it may sample in all; ``max_context``: the
    longest prompt + completion of one call; ``expires_at``: monotonic seconds."""

    session_id: str
    budget_tokens: int
    max_context: int
    expires_at: float
    info: dict[str, Any] = field(default_factory=dict)
    calls: list[CallRecord] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    sampled_tokens: int = 0
    continued: int = 0
    forked: int = 0
    auxiliary: int = 0
    closed: bool = False
    reward: float | None = None

    @property
    def budget_left(self) -> int:
        return self.budget_tokens - self.sampled_tokens

    def tie(self, call: CallRecord) -> None:
        """Record ``call`` and join it to the sample whose ids its prompt extends (the longest such), else start a
        new sample; counts ``continued`` / ``forked``. The first call of a session starts its first sample and is
        neither."""
        prompt = call.prompt_ids
        best = -1
        for k, s in enumerate(self.samples):
            ids = s.ids
            if len(ids) <= len(prompt) and prompt[: len(ids)] == ids and (best < 0 or len(ids) > len(
                    self.samples[best].ids)):
                best = k
        if best >= 0:
            s = self.samples[best]
            obs = prompt[len(s.ids):]
            s.token_ids += obs
            s.logprobs += [0.0] * len(obs)
            s.action_mask += [False] * len(obs)
            self.continued += 1
            call.continued = True
        else:
            if self.samples:
                self.forked += 1
            s = Sample(list(prompt))
            self.samples.append(s)
            best = len(self.samples) - 1
        s.token_ids += call.completion_ids
        s.logprobs += call.logprobs
        s.action_mask += [True] * len(call.completion_ids)
        s.versions.append(call.weight_version)
        s.finish_reason = call.finish_reason
        s.calls += 1
        call.sample = best
        self.calls.append(call)
        self.sampled_tokens += len(call.completion_ids)

    def record_auxiliary(self, call: CallRecord) -> None:
        """Record an auxiliary ``call`` (its tokens count against the budget) without joining it to a sample."""
        call.auxiliary, call.sample = True, -1
        self.calls.append(call)
        self.auxiliary += 1
        self.sampled_tokens += len(call.completion_ids)


class SessionStore:
    """Sessions by API key. :meth:`open` makes one (its key: 32 random bytes, URL-safe); :meth:`lookup` finds a
    live one (None for an unknown, closed or expired key); :meth:`close` ends it and returns its record."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._by_key: dict[str, Session] = {}
        self._by_id: dict[str, str] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def open(self, budget_tokens: int, max_context: int, ttl_s: float, **info) -> tuple[Session, str]:
        if budget_tokens < 1 or max_context < 2 or ttl_s <= 0:
            raise ValueError(f"session: budget_tokens {budget_tokens} must be >= 1, max_context {max_context} >= 2, "
                             f"ttl_s {ttl_s} > 0")
        key = secrets.token_urlsafe(32)
        session = Session(secrets.token_hex(8), budget_tokens, max_context, self._clock() + ttl_s, info)
        with self._lock:
            self._by_key[key] = session
            self._by_id[session.session_id] = key
        return session, key

    def lookup(self, key: str | None) -> Session | None:
        if not key:
            return None
        with self._lock:
            session = self._by_key.get(key)
        if session is None or session.closed or self._clock() >= session.expires_at:
            return None
        return session

    def close(self, session_id: str) -> Session:
        """End the session (its key answers 401 from now on) and return it with its calls and samples."""
        with self._lock:
            key = self._by_id.pop(session_id)
            session = self._by_key.pop(key)
        session.closed = True
        return session
