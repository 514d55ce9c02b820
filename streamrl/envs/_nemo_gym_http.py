"""Talking to a NeMo Gym resources server: one POST with retries (sync for the verifier
worker, async for the rollout worker, both from one ``RetryPolicy``), the session's cookie
jar carried by the caller, and the checks on what ``/seed_session`` and ``/verify`` answer.
Which failures are retried and what is raised is described in ``nemo_gym``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from email.utils import parsedate_to_datetime
from http.cookiejar import CookieJar, DefaultCookiePolicy
from http.cookies import CookieError, SimpleCookie
from typing import Any, NamedTuple

from streamrl.defaults import NEMO_GYM_BODY_SNIPPET
from streamrl.envs.base import EnvUnavailable
from streamrl.envs.external import CallUnconfirmed
from streamrl.http import Retryable, RetryPolicy, httpx_api

_RETRY_STATUS = frozenset({408, 425, 429})


class Answer(NamedTuple):
    status: int
    body: bytes
    cookies: dict[str, str]
    parsed: Any


class _Malformed(Exception):
    pass


def snippet(body: bytes | str) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    text = " ".join(text.split())
    n = NEMO_GYM_BODY_SNIPPET
    return text if len(text) <= n else text[:n] + "..."


def merge_cookies(jar: dict[str, str], set_cookie: list[str]) -> dict[str, str]:
    """The jar after a response's ``Set-Cookie`` headers (one host, so name -> value; a cookie
    that expires now, as Starlette clears an emptied session, is removed)."""
    if not set_cookie:
        return jar
    jar = dict(jar)
    for header in set_cookie:
        parsed = SimpleCookie()
        try:
            parsed.load(header)
        except CookieError:
            continue
        for name, morsel in parsed.items():
            expired = morsel["max-age"] in ("0", "-1")
            if morsel["expires"]:
                with contextlib.suppress(TypeError, ValueError):
                    when = parsedate_to_datetime(morsel["expires"]).timestamp()
                    expired = expired or when <= time.time()
            if expired:
                jar.pop(name, None)
            else:
                jar[name] = morsel.value
    return jar


def _cookie_header(jar: dict[str, str]) -> dict[str, str]:
    return {"cookie": "; ".join(f"{k}={v}" for k, v in jar.items())} if jar else {}


def _json_object(body: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _Malformed(f"{what} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise _Malformed(f"{what} is not a JSON object but {type(value).__name__}")
    return value


def seed_answer(body: bytes) -> dict[str, Any]:
    return _json_object(body, "the /seed_session answer")


def verify_answer(body: bytes) -> dict[str, Any]:
    answer = _json_object(body, "the /verify answer")
    reward = answer.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise _Malformed(f"the /verify answer has no numeric reward (reward={reward!r})")
    if not math.isfinite(reward):
        raise _Malformed(f"the /verify answer's reward is not finite ({reward!r})")
    return answer


class ResourcesServer:
    """The HTTP clients of one server (an async one per event loop, a sync one for
    ``verify``), created on first use."""

    def __init__(
        self,
        base_url: str,
        retry: RetryPolicy,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        max_connections: int,
        keepalive: bool = True,
    ) -> None:
        self.base_url = base_url
        self._keepalive = keepalive
        self.retry = retry
        self.timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._aclient: Any = None
        self._aclient_loop: Any = None
        self._client: Any = None

    def _client_kwargs(self) -> dict[str, Any]:
        http = httpx_api()
        # the client's own jar accepts nothing: every session's cookies travel in its state
        jar = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
        return {
            "timeout": http.Timeout(self.timeout_s, connect=self._connect_timeout_s),
            "limits": http.Limits(
                max_connections=self._max_connections,
                max_keepalive_connections=self._max_connections if self._keepalive else 0,
            ),
            "cookies": jar,
            "trust_env": False,  # a resources server is a local service: no proxy
        }

    def _async_client(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._aclient is None or self._aclient_loop is not loop:
            self._aclient = httpx_api().AsyncClient(**self._client_kwargs())
            self._aclient_loop = loop
        return self._aclient

    def _sync_client(self) -> Any:
        if self._client is None:
            self._client = httpx_api().Client(**self._client_kwargs())
        return self._client

    async def aclose(self) -> None:
        if self._aclient is not None:
            client, self._aclient = self._aclient, None
            await client.aclose()

    async def apost(
        self,
        path: str,
        body: Any,
        jar: dict[str, str],
        parse: Any = None,
        tool: bool = False,
        idempotent: bool = True,
    ) -> Answer:
        """``POST path``, retried; ``tool``: a 4xx is an answer (a tool's error output, a
        refusal the caller reads), not an ``EnvUnavailable``. Not
        ``idempotent`` (a tool call): a transport failure after the request may have reached
        the server is ``CallUnconfirmed``, never a retry; one before it (no connection) is
        retried."""
        http = httpx_api()
        transport_error = http.TransportError
        unsent = (http.ConnectError, http.ConnectTimeout, http.PoolTimeout)
        client = self._async_client()

        async def attempt() -> Answer:
            try:
                resp = await client.post(self._url(path), json=body, headers=_cookie_header(jar))
            except transport_error as e:  # connect/read errors and timeouts
                if not idempotent and not isinstance(e, unsent):
                    raise CallUnconfirmed(
                        f"{self._failure(path, e)}: the request may have been applied"
                    ) from e
                raise Retryable(self._failure(path, e)) from e
            return self._answer(path, resp, jar, parse, tool)

        return await self.retry.acall(attempt, self._give_up)

    async def aget_json(self, path: str) -> Any:
        """``GET path`` once, its JSON, or None on any failure (a probe, never retried)."""
        try:
            resp = await self._async_client().get(self._url(path))
            return resp.json() if resp.status_code == 200 else None
        except Exception:
            return None

    def post(
        self, path: str, body: Any, jar: dict[str, str], parse: Any = None, tool: bool = False
    ) -> Answer:
        """``apost`` for a caller without an event loop (``verify``)."""
        transport_error = httpx_api().TransportError
        client = self._sync_client()

        def attempt() -> Answer:
            try:
                resp = client.post(self._url(path), json=body, headers=_cookie_header(jar))
            except transport_error as e:
                raise Retryable(self._failure(path, e)) from e
            return self._answer(path, resp, jar, parse, tool)

        return self.retry.call(attempt, self._give_up)

    def _url(self, path: str) -> str:
        return self.base_url + path

    def _give_up(self, last: BaseException) -> EnvUnavailable:
        return EnvUnavailable(f"{last} (after {self.retry.tries} attempts)")

    def _answer(self, path: str, resp: Any, jar: dict, parse: Any, tool: bool) -> Answer:
        """The answer; Retryable saying why to try again; EnvUnavailable on a final refusal."""
        status = resp.status_code
        jar = merge_cookies(jar, resp.headers.get_list("set-cookie"))
        if status in _RETRY_STATUS or status >= 500:
            raise Retryable(f"HTTP {status} from POST {path}: {snippet(resp.content)}")
        if 400 <= status < 500:
            if tool:  # the model's mistake: the body is the tool's error output
                return Answer(status, resp.content, jar, None)
            raise EnvUnavailable(
                f"HTTP {status} from POST {path} (the server refused the request; not "
                f"retried): {snippet(resp.content)}"
            )
        try:
            parsed = parse(resp.content) if parse is not None else None
        except _Malformed as e:
            raise Retryable(
                f"malformed answer from POST {path} (HTTP {status}): {e}: {snippet(resp.content)}"
            ) from None
        return Answer(status, resp.content, jar, parsed)

    def _failure(self, path: str, e: Exception) -> str:
        if isinstance(e, httpx_api().TimeoutException):
            return f"timeout on POST {path} ({type(e).__name__}, timeout_s={self.timeout_s})"
        return f"connection error on POST {path}: {type(e).__name__}: {e}"
