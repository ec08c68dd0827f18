"""An OpenAI-compatible endpoint in front of the run's engines: agent harnesses point their ``base_url`` here.

``/v1/chat/completions`` (tools included), ``/v1/completions``, ``/v1/models`` and ``/v1/rl/reward`` (the
session's reward, posted by a harness that does not return it), served by FastAPI on uvicorn in
a thread of the trainer's process (:class:`EndpointServer`), bound to 127.0.0.1 unless told otherwise. The door
into the trainer is kept shut:

* every request names its session by its API key (``Authorization: Bearer``, :class:`SessionStore`); a wrong,
  closed or expired key gets 401 before the body is read, and nothing is recorded or generated;
* ``stream: true`` on chat gets the finished completion replayed as server-sent events (every id is recorded
  before the first byte goes out);
* a body over ``max_request_bytes`` gets 413, one that is not JSON or not a valid request 400 with a message;
* a call samples at most the session's budget left and what the context allows; a session with no budget left
  or a prompt that fills the context gets 400 (the openai client retries 429 and 5xx, not 400); a generation
  error is the call's answer (400 or 500), never a crash of the rollout.

A call is rendered by the model's renderer (:mod:`rlhf_sg.serve.renderer`), generated on the engine the router
picks for the session (:mod:`rlhf_sg.serve.router`; one call at a time per engine object, since a backend's
``generate`` is not reentrant), and recorded token-exact (:class:`rlhf_sg.serve.sessions.CallRecord`). A
generation cut short by a weight sync (finish ``abort``) goes on from its tokens so far with the budget left, as
the trainer's partial rollout does; the call keeps the oldest version. Responses carry OpenAI's fields and, as
vLLM's ``return_token_ids`` does, ``prompt_token_ids`` (top level) and ``token_ids`` (per choice).

A call sent with the header ``X-RL-Auxiliary: true`` (a title, a summary, a judge the harness asks aside) is served
and recorded with the session's budget but is no part of any sample, so it is not trained on; later calls never
continue from its ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request  # the annotations of the routes below are resolved from this module
from fastapi.responses import JSONResponse, StreamingResponse

from rlhf_sg.serve.renderer import Renderer, RenderError, renderer_for
from rlhf_sg.serve.router import Router
from rlhf_sg.serve.sessions import CallRecord, Session, SessionStore

__all__ = ["AUXILIARY_HEADER", "Endpoint", "EndpointServer", "RequestError"]

#: the request header that marks a call auxiliary (left out of training): ``true`` or ``1``
AUXILIARY_HEADER = "X-RL-Auxiliary"


class RequestError(Exception):
    """A request the endpoint refuses: HTTP ``status``, OpenAI error ``code`` and a message saying what to do."""

    def __init__(self, status: int, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.status, self.code = status, code


def _error(status: int, message: str, code: str) -> JSONResponse:
    kind = {401: "authentication_error", 413: "invalid_request_error"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status)


def _int(body: dict, key: str, default, low: int = 1):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise RequestError(400, f"{key!r} must be an integer >= {low}, got {v!r}")
    return v


def _float(body: dict, key: str, default: float, low: float, high: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
        raise RequestError(400, f"{key!r} must be a number in [{low}, {high}], got {v!r}")
    return float(v)


def _same_reply(sent: dict | None, back: dict) -> bool:
    """Whether the assistant message the harness sends back is the one it was given (content and tool calls by
    name and parsed arguments; ids and extra keys aside)."""
    if sent is None or back.get("role") != "assistant":
        return False

    def calls(m):
        out = []
        for c in m.get("tool_calls") or []:
            fn = c.get("function", c) if isinstance(c, dict) else {}
            args = fn.get("arguments")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                return None
            out.append((fn.get("name"), args))
        return out

    return ((sent.get("content") or "").strip() == (back.get("content") or "").strip()
            and calls(sent) == calls(back))


def _replay(response: dict, usage: bool):
    """A finished chat completion as server-sent events (``stream: true``): the role, the content, each tool call,
    then the finish reason (and the usage when asked), as OpenAI streams them. The engine generated it whole first:
    a replay, so streaming clients work and every id was recorded before the first byte goes out."""
    choice = response["choices"][0]
    message = choice["message"]
    head = {k: response[k] for k in ("id", "created", "model")}

    def chunk(delta: dict, finish=None, **extra) -> str:
        body = {**head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
        return f"data: {json.dumps(body)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if message.get("content"):
        yield chunk({"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, choice["finish_reason"])
    if usage:
        last = {**head, "object": "chat.completion.chunk", "choices": [], "usage": response["usage"]}
        yield f"data: {json.dumps(last)}\n\n"
    yield "data: [DONE]\n\n"


class Endpoint:
    """The OpenAI-compatible front of ``engines`` (objects with a backend's ``generate(prompts, params)``).

    tokenizer: the policy's; model_name: what ``/v1/models`` lists; router: over the engines (default sticky
    least-loaded); stop_token_ids: every end of a model turn (default the tokenizer's EOS); max_request_bytes:
    the largest body; generate_timeout_s: one engine call at most (then 504)."""

    def __init__(self, engines: Sequence[Any], tokenizer, model_name: str, router: Router | None = None,
                 store: SessionStore | None = None, stop_token_ids: Sequence[int] | None = None,
                 max_request_bytes: int = 1 << 20, generate_timeout_s: float = 600.0):
        self.engines, self.tokenizer, self.model_name = list(engines), tokenizer, model_name
        self.router = router or Router(len(self.engines))
        self.store = store or SessionStore()
        eos = tokenizer.eos_token_id
        self.stop_token_ids = tuple(stop_token_ids) if stop_token_ids is not None else ((eos,) if eos is not None
                                                                                        else ())
        self.max_request_bytes, self.generate_timeout_s = max_request_bytes, generate_timeout_s
        self._engine_locks = [threading.Lock() for _ in self.engines]
        self._renderer: Renderer | None = None
        self._session_locks: dict[str, asyncio.Lock] = {}  # made and used on the server's event loop
        self.vocab_size = len(tokenizer)

    @property
    def renderer(self) -> Renderer:
        if self._renderer is None:
            self._renderer = renderer_for(self.tokenizer)
        return self._renderer

    # ---- sessions (the trainer's side) --------------------------------------------------------------------------
    def open_session(self, budget_tokens: int, max_context: int, ttl_s: float = 3600.0, **info) -> tuple[Session, str]:
        """A session for one harness run and its API key."""
        return self.store.open(budget_tokens, max_context, ttl_s, **info)

    def close_session(self, session_id: str) -> Session:
        """End a session (its key answers 401 from now on; its engine is released) and return its record."""
        session = self.store.close(session_id)
        self.router.release(session_id)
        self._session_locks.pop(session_id, None)
        return session

    # ---- one call ---------------------------------------------------------------------------------------------
    def _generate(self, engine: int, prompt: list[int], params) -> tuple[list[int], list[float], str, list[int]]:
        """Generate on ``engine``, continuing after a weight sync's abort; (ids, logprobs, finish, versions)."""
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        budget = params.max_new_tokens
        part = 0
        while True:
            call = dataclasses.replace(params, max_new_tokens=budget - len(ids),
                                       seed=None if params.seed is None else params.seed + part)
            with self._engine_locks[engine]:
                (c,) = self.engines[engine].generate([prompt + ids], call)
            ids += list(c.token_ids)
            logprobs += [float(x) for x in c.logprobs]
            versions.append(int(c.weight_version))
            self.router.record_cache(engine, len(prompt) + len(ids) - len(c.token_ids), c.cached_tokens)
            if c.finish_reason != "abort" or len(ids) >= budget:
                return ids, logprobs, ("length" if c.finish_reason == "abort" else c.finish_reason), versions
            part += 1

    async def _run(self, session: Session, prompt: list[int], body: dict, kind: str) -> CallRecord:
        from backends.base import SamplingParams

        if len(prompt) + 1 > session.max_context:
            raise RequestError(400, f"the prompt has {len(prompt)} tokens; this session's context is "
                                    f"{session.max_context} (prompt + completion): shorten the conversation",
                               "context_length_exceeded")
        if session.budget_left <= 0:
            raise RequestError(400, f"this session has sampled its budget of {session.budget_tokens} tokens; end "
                                    "the episode", "budget_exhausted")
        asked = _int(body, "max_completion_tokens", None) or _int(body, "max_tokens", None)
        room = min(session.budget_left, session.max_context - len(prompt))
        params = SamplingParams(
            temperature=_float(body, "temperature", 1.0, 0.0, 2.0), top_p=_float(body, "top_p", 1.0, 1e-6, 1.0),
            max_new_tokens=min(asked or room, room), stop_token_ids=self.stop_token_ids,
            seed=_int(body, "seed", None, low=0))
        with self.router.call(session.session_id, len(prompt) + params.max_new_tokens) as engine:
            try:
                ids, logprobs, finish, versions = await asyncio.wait_for(
                    asyncio.to_thread(self._generate, engine, prompt, params), self.generate_timeout_s)
            except asyncio.TimeoutError as e:
                raise RequestError(504, f"the engine did not answer within {self.generate_timeout_s} s",
                                   "timeout") from e
            except Exception as e:  # noqa: BLE001 - an engine's refusal is this call's answer, not the server's end
                from backends.base import BackendError

                status = 400 if isinstance(e, BackendError) else 500
                raise RequestError(status, f"generation failed: {type(e).__name__}: {e}", "generation_failed") from e
        return CallRecord(prompt_ids=list(prompt), completion_ids=ids, logprobs=logprobs, weight_version=min(versions),
                          finish_reason=finish, engine=engine, kind=kind)

    def _chat_prompt(self, session: Session, messages: list[dict], tools) -> list[int]:
        """The prompt ids: an earlier chat call's exact ids (the latest whose conversation and reply the new messages
        extend) continued by the rendering of the messages after it; else the whole conversation rendered."""
        for prev in reversed(session.calls):
            if prev.kind != "chat" or prev.auxiliary or not prev.completion_ids or prev.finish_reason != "stop":
                continue
            k = len(prev.messages)
            if (len(messages) > k + 1 and messages[:k] == prev.messages and tools == prev.tools
                    and _same_reply(prev.reply, messages[k])):
                tail = self.renderer.extend(messages, tools, k, prev.completion_ids[-1])
                if tail is not None:
                    return prev.prompt_ids + prev.completion_ids + tail
        return self.renderer.render(messages, tools)

    async def chat(self, session: Session, body: dict, auxiliary: bool = False) -> dict:
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise RequestError(400, "'messages' must be a non-empty list of objects, each with a 'role'")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise RequestError(400, "'tools' must be a list of objects ({'type': 'function', 'function': {...}})")
        self._common_checks(body, streams=True)
        try:
            prompt = self._chat_prompt(session, messages, tools)
        except RenderError as e:
            raise RequestError(400, str(e), "render_failed") from e
        call = await self._run(session, prompt, body, "chat")
        parsed = self.renderer.parse(call.completion_ids)
        call.messages, call.tools, call.reply = messages, tools, parsed.message()
        call.tool_calls, call.tool_parse_errors = len(parsed.tool_calls), parsed.parse_errors
        (session.record_auxiliary if auxiliary else session.tie)(call)
        finish = "tool_calls" if parsed.tool_calls and call.finish_reason == "stop" else call.finish_reason
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "prompt_token_ids": call.prompt_ids,
            "choices": [{"index": 0, "message": parsed.message(), "finish_reason": finish, "logprobs": None,
                         "token_ids": call.completion_ids}],
            "usage": self._usage(call),
        }

    async def complete(self, session: Session, body: dict, auxiliary: bool = False) -> dict:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, str) and prompt:
            ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError(400, f"'prompt' must be one non-empty string or one list of token ids in "
                                    f"[0, {self.vocab_size})")
        self._common_checks(body)
        call = await self._run(session, ids, body, "completion")
        (session.record_auxiliary if auxiliary else session.tie)(call)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_name, "prompt_token_ids": call.prompt_ids,
            "choices": [{"index": 0, "text": self.tokenizer.decode(call.completion_ids, skip_special_tokens=True),
                         "finish_reason": call.finish_reason, "logprobs": None, "token_ids": call.completion_ids}],
            "usage": self._usage(call),
        }

    async def set_reward(self, session: Session, body: dict) -> dict:
        """``POST /v1/rl/reward {"reward": float}``: the session's reward, when the harness reports it to the
        endpoint instead of returning it (a returned value wins)."""
        value = body.get("reward")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RequestError(400, f"'reward' must be a finite number, got {value!r}")
        session.reward = float(value)
        return {"session": session.session_id, "reward": session.reward}

    @staticmethod
    def _common_checks(body: dict, streams: bool = False) -> None:
        if _int(body, "n", 1) != 1:
            raise RequestError(400, "'n' must be 1: each sample is its own harness run (its own session)")
        if body.get("stream") and not streams:
            raise RequestError(400, "'stream' is served for /v1/chat/completions only: send this request with stream "
                                    "false")
        if body.get("stop"):
            raise RequestError(400, "'stop' strings are not served: the model's end-of-turn tokens end a turn")

    @staticmethod
    def _usage(call: CallRecord) -> dict:
        return {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(call.completion_ids),
                "total_tokens": len(call.prompt_ids) + len(call.completion_ids)}

    # ---- HTTP -------------------------------------------------------------------------------------------------
    def app(self):
        """The FastAPI application."""
        app = FastAPI(title="rlhf_sg endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        def session_of(request: Request) -> Session | None:
            auth = request.headers.get("authorization", "")
            key = auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else None
            return self.store.lookup(key)

        def auxiliary_call(request: Request) -> bool:
            value = request.headers.get(AUXILIARY_HEADER, "").strip().lower()
            if value not in ("", "true", "1", "false", "0"):
                raise RequestError(400, f"header {AUXILIARY_HEADER}: {value!r} is not true, 1, false or 0")
            return value in ("true", "1")

        async def read_json(request: Request) -> dict:
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
                raise RequestError(413, f"the request body is {declared} bytes, over the endpoint's "
                                        f"{self.max_request_bytes}", "request_too_large")
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_request_bytes:
                    raise RequestError(413, f"the request body is over the endpoint's {self.max_request_bytes} "
                                            "bytes", "request_too_large")
                chunks.append(chunk)
            try:
                body = json.loads(b"".join(chunks))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(400, f"the request body is not JSON: {e}", "invalid_json") from e
            if not isinstance(body, dict):
                raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                                   "invalid_json")
            return body

        async def serve(request: Request, handler):
            session = session_of(request)
            if session is None:
                return _error(401, "unknown, closed or expired API key: each harness run gets the key of its own "
                                   "session", "invalid_api_key")
            try:
                body = await read_json(request)
                lock = self._session_locks.setdefault(session.session_id, asyncio.Lock())
                async with lock:  # one call at a time per session: calls tie to samples in order
                    if session.closed:
                        raise RequestError(401, "the session was closed", "invalid_api_key")
                    return await handler(session, body)
            except RequestError as e:
                return _error(e.status, str(e), e.code)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            streamed = {}

            async def chat(session, body):
                streamed["usage"] = bool(body.get("stream")) and bool((body.get("stream_options") or {}).get(
                    "include_usage"))
                streamed["on"] = bool(body.get("stream"))
                return await self.chat(session, body, auxiliary_call(request))

            out = await serve(request, chat)
            if not streamed.get("on") or not isinstance(out, dict):
                return out
            return StreamingResponse(_replay(out, streamed["usage"]), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await serve(request, lambda session, body: self.complete(session, body, auxiliary_call(request)))

        @app.post("/v1/rl/reward")
        async def reward(request: Request):
            return await serve(request, self.set_reward)

        @app.get("/v1/models")
        async def models(request: Request):
            if session_of(request) is None:
                return _error(401, "unknown, closed or expired API key", "invalid_api_key")
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "rlhf_sg"}]}

        return app


class EndpointServer:
    """Runs an :class:`Endpoint` on uvicorn in a daemon thread: ``start()`` returns the base URL (``.../v1``)."""

    def __init__(self, endpoint: Endpoint, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.endpoint = endpoint
        self._server = uvicorn.Server(uvicorn.Config(endpoint.app(), host=host, port=port, log_level="warning",
                                                     lifespan="off", access_log=False))
        self._thread: threading.Thread | None = None
        self.host = host

    def start(self, timeout_s: float = 30.0) -> str:
        self._thread = threading.Thread(target=self._server.run, name="rlhf_sg-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the endpoint did not start on {self.host} within {timeout_s} s (port taken?)")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        return f"http://{self.host}:{port}/v1"

    def stop(self, timeout_s: float = 30.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
