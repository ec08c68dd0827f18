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
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

RewardFn = Callable[[list[str], list[str], list], Sequence[float]]


class RewardError(ValueError):
    """A reward source is misconfigured or returned something unusable."""


def load_reward_function(spec: str) -> RewardFn:
    """Import ``module:function`` and check it takes (prompts, completions, labels)."""
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
) -> list[float]:
    """POST ``{"prompts", "completions", "labels"}`` as JSON; expects ``{"rewards": [...]}``.

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
    try:
        with _opener(ca_file).open(request, timeout=timeout_s) as response:
            payload = json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise RewardError(f"remote reward {url}: {_http_error_hint(e, token_env)}") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, ssl.SSLCertVerificationError):
            raise RewardError(
                f"remote reward {url}: the server's TLS certificate failed verification ({e.reason.verify_message}); "
                "if it is signed by a private CA, pass that CA's certificate with --reward.ca_file PATH"
            ) from None
        raise RewardError(f"remote reward {url}: request failed ({e.reason})") from None
    except OSError as e:
        raise RewardError(f"remote reward {url}: request failed or timed out after {timeout_s:.0f} s ({e})") from None
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
