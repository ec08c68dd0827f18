"""Reward sources: a Python rule function, or a remote HTTP scorer. (Reward *models* run as a
:class:`rlhf_sg.workers.ModelGroup` of role ``reward``.)

A reward function has the signature ``fn(prompts: list[str], completions: list[str], labels: list)
-> list[float]`` — one score per completion, in order. ``labels`` holds each prompt's label column
(``--data.label_key``) or ``None``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import ipaddress
import json
import logging
import math
import os
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

RewardFn = Callable[[list[str], list[str], list], Sequence[float]]


class RewardError(ValueError):
    """A reward source is misconfigured or returned something unusable."""


def load_reward_function(spec: str) -> RewardFn:
    """Import ``module:function`` and check it takes (prompts, completions, labels); or a built-in verifiable
    reward by name, or a weighted sum of rewards (:mod:`rlhf_sg.verifiable`)."""
    from rlhf_sg.verifiable import VerifiableRewardError, is_builtin_spec, load_builtin

    if is_builtin_spec(spec):
        try:
            return load_builtin(spec, load_reward_function)
        except VerifiableRewardError as e:
            raise RewardError(str(e)) from e
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RewardError(f"--reward.function must look like module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(
            f"--reward.function {spec!r}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"--reward.function {spec!r}: {module_name} has no callable {attr!r}")
    try:
        inspect.signature(fn).bind([], [], [])
    except TypeError as e:
        raise RewardError(
            f"--reward.function {spec!r} must accept (prompts, completions, labels); its signature is "
            f"{inspect.signature(fn)}"
        ) from e
    return fn


def check_scores(scores: Sequence[float], n: int, source: str) -> list[float]:
    """One finite float per completion, or a RewardError naming the source and the bad entry."""
    scores = list(scores)
    if len(scores) != n:
        raise RewardError(f"{source} returned {len(scores)} scores for {n} completions")
    out = []
    for i, s in enumerate(scores):
        try:
            f = float(s)
        except (TypeError, ValueError) as e:
            raise RewardError(f"{source}: score {i} is {s!r}, not a number") from e
        if not math.isfinite(f):
            raise RewardError(f"{source}: score {i} is {f}; rewards must be finite")
        out.append(f)
    return out


def _excerpt(text: str, width: int = 60) -> str:
    return repr(text if len(text) <= width else text[:width] + "...")


def _call_with_timeout(fn, args: tuple, timeout_s: float):
    """``fn(*args)`` in a daemon thread; (True, result or the exception it raised), or (False, None) when it did
    not return within ``timeout_s`` (the thread is left behind: Python cannot stop it)."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args)
        except Exception as e:  # handed to the caller, which names the function and the sample
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True, name="reward-function")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return False, None
    return True, box["error"] if "error" in box else box["result"]


def score_with_function(
    fn: RewardFn, name: str, prompts: list[str], completions: list[str], labels: list, *,
    on_error: str = "raise", timeout_s: float = 600.0,
) -> tuple[list[float], int]:
    """Scores of a reward function, and how many completions it failed on.

    The batch is scored in one call. When that call raises or returns the wrong number of scores, each
    completion is scored alone to find the ones it fails on. A completion whose score is an exception, not a
    number, or not finite is an error: with ``on_error="raise"`` a RewardError names the function, the sample
    (index, prompt, completion) and what went wrong; with ``on_error="zero"`` it scores 0 and is counted. A call
    that does not return within ``timeout_s`` fails the whole batch the same way.
    """
    n = len(completions)

    def fail(i: int | None, what: str) -> None:
        if on_error == "raise":
            where = (f"sample {i} (prompt {_excerpt(prompts[i])}, completion {_excerpt(completions[i])})"
                     if i is not None else f"a batch of {n} completions")
            raise RewardError(f"reward function {name}: {where}: {what}; fix the function, or score such "
                              "samples 0 with --reward.on_error zero")

    done, result = _call_with_timeout(fn, (prompts, completions, labels), timeout_s)
    if not done:
        fail(None, f"no answer within {timeout_s:g} s (--reward.timeout_s)")
        log.warning("reward function %s: no answer within %g s; %d completions score 0", name, timeout_s, n)
        return [0.0] * n, n
    if isinstance(result, Exception) or not _is_sized(result) or len(result) != n:
        # find the samples it fails on
        results = []
        for i in range(n):
            done, one = _call_with_timeout(fn, ([prompts[i]], [completions[i]], [labels[i]]), timeout_s)
            if not done:
                results.append(RewardError(f"no answer within {timeout_s:g} s (--reward.timeout_s)"))
            elif isinstance(one, Exception):
                results.append(one)
            elif not _is_sized(one) or len(one) != 1:
                results.append(RewardError(f"returned {_describe(one)} for one completion"))
            else:
                results.append(one[0])
        if not isinstance(result, Exception) and all(not isinstance(r, Exception) for r in results):
            fail(None, f"returned {_describe(result)} for {n} completions, though each alone scores")
        result = results
    scores, errors = [], 0
    for i, value in enumerate(result):
        what = None
        if isinstance(value, Exception):
            what = f"raised {type(value).__name__}: {value}"
        else:
            try:
                value = float(value)
                if not math.isfinite(value):
                    what = f"score {value} is not finite"
            except (TypeError, ValueError):
                what = f"score {value!r} is not a number"
        if what is not None:
            fail(i, what)
            errors += 1
            value = 0.0
        scores.append(value)
    if errors:
        log.warning("reward function %s: %d of %d completions failed and score 0 (--reward.on_error zero)", name,
                    errors, n)
    return scores, errors


def _is_sized(x) -> bool:
    return hasattr(x, "__len__") and hasattr(x, "__getitem__") and not isinstance(x, (str, bytes, dict))


def _describe(x) -> str:
    return f"{len(x)} scores" if _is_sized(x) else f"a {type(x).__name__}"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuse redirects: urllib would resend the Authorization header to wherever one points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} refused", headers, fp)


@functools.lru_cache(maxsize=8)
def _opener(ca_file: str | None) -> urllib.request.OpenerDirector:
    """An opener that checks TLS certificates (against ``ca_file`` when given, else the system's CAs)
    and follows no redirect."""
    context = ssl.create_default_context(cafile=ca_file)
    return urllib.request.build_opener(urllib.request.HTTPSHandler(context=context), _NoRedirect())


def bearer_token(env_var: str, flag: str) -> str:
    """The secret held by environment variable ``env_var`` (named by ``flag``), or a RewardError saying
    what to set. The message names the variable, never its value."""
    token = os.environ.get(env_var, "")
    if not token.strip():
        raise RewardError(
            f"{flag} names the environment variable {env_var}, which is not set (or empty) in this process; "
            f"export {env_var}=<token> before starting the run"
        )
    return token.strip()


def remote_reward(
    url: str,
    prompts: list[str],
    completions: list[str],
    labels: list,
    timeout_s: float,
    *,
    token_env: str | None = None,
    ca_file: str | None = None,
    retries: int = 0,
    backoff_s: float = 1.0,
) -> list[float]:
    """POST ``{"prompts", "completions", "labels"}`` as JSON; expects ``{"rewards": [...]}``.

    A server that is down, slow (``timeout_s``) or answers 5xx is asked again up to ``retries`` times, waiting
    ``backoff_s``, then twice that, and so on; then a RewardError says what happened. A 4xx answer is not retried.

    ``token_env``: the environment variable holding a bearer token, sent as ``Authorization: Bearer
    <token>`` (read at each call, so it never sits in the config). TLS certificates are always
    checked (https); ``ca_file`` adds a private CA's certificate (PEM) to trust. Redirects are refused.
    """
    headers = {"Content-Type": "application/json"}
    if token_env:
        headers["Authorization"] = f"Bearer {bearer_token(token_env, '--reward.token_env')}"
        if not _tls_or_loopback(url):
            _warn_plain_http(url)
    body = json.dumps({"prompts": prompts, "completions": completions, "labels": labels}).encode()
    request = urllib.request.Request(url, data=body, headers=headers)
    payload = None
    for attempt in range(retries + 1):
        try:
            with _opener(ca_file).open(request, timeout=timeout_s) as response:
                payload = json.loads(response.read())
            break
        except urllib.error.HTTPError as e:
            if e.code < 500 or attempt == retries:  # a client error does not get better by asking again
                raise RewardError(f"remote reward {url}: {_http_error_hint(e, token_env)}"
                                  + (f" (after {attempt + 1} attempts)" if attempt else "")) from None
            problem = f"answered {e.code} {e.reason}"
        except urllib.error.URLError as e:
            if isinstance(e.reason, ssl.SSLCertVerificationError):
                raise RewardError(
                    f"remote reward {url}: the server's TLS certificate failed verification "
                    f"({e.reason.verify_message}); if it is signed by a private CA, pass that CA's certificate with "
                    "--reward.ca_file PATH"
                ) from None
            problem = f"request failed ({e.reason})"
        except OSError as e:
            problem = f"request failed or timed out after {timeout_s:.0f} s ({e})"
        if attempt == retries:
            raise RewardError(f"remote reward {url}: {problem}, {retries + 1} attempts; is the server up and "
                              "reachable? (--reward.retries, --train.timeout_s)") from None
        delay = backoff_s * 2**attempt
        log.warning("remote reward %s: %s; retrying in %.1f s (attempt %d of %d)", url, problem, delay, attempt + 2,
                    retries + 1)
        time.sleep(delay)
    if not isinstance(payload, dict) or "rewards" not in payload:
        raise RewardError(f"remote reward {url}: expected a JSON object with 'rewards', got {str(payload)[:200]}")
    return check_scores(payload["rewards"], len(completions), f"remote reward {url}")


def _tls_or_loopback(url: str) -> bool:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme == "https":
        return True
    try:
        return ipaddress.ip_address(parsed.hostname or "").is_loopback
    except ValueError:
        return parsed.hostname == "localhost"


@functools.cache
def _warn_plain_http(url: str) -> None:
    log.warning(
        "remote reward %s: the bearer token goes over plain http, readable by anyone on the network path; "
        "serve the reward over https (--reward.ca_file for a private CA) unless this network is trusted",
        url,
    )


def _http_error_hint(e: urllib.error.HTTPError, token_env: str | None) -> str:
    if e.code in (401, 403):
        if token_env:
            return (
                f"answered {e.code} {e.reason}: the server refused the bearer token from environment variable "
                f"{token_env} (--reward.token_env); set {token_env} to a token this server accepts"
            )
        return (
            f"answered {e.code} {e.reason}: the server wants credentials; put its bearer token in an environment "
            "variable and name that variable with --reward.token_env"
        )
    if 300 <= e.code < 400:
        return (
            f"answered {e.code} (a redirect to {e.headers.get('Location')}); redirects are not followed, so "
            "credentials never reach another address: set --reward.url to the final URL"
        )
    return f"answered {e.code} {e.reason}: {e.read().decode(errors='replace')[:500]}"
