"""``nemo-gym`` with ``mode=run``: a NeMo Gym 0.7 *environment server* drives the episode.

``POST /run`` takes ``{episode_id: {rollout_id, attempt}, task: {task_id: {taskset, task_id},
task_input}}`` (``task_input``: the row as 0.7's ``SingleAgentTurnTaskInput`` reads it,
``responses_create_params`` and the other fields as ``task_data``) and answers ``{episode_id,
task_id, result}`` (the resources server's ``/verify`` answer: ``reward``, ``response``...) or
``{..., failure: {failure_reason, terminal, stage}}``. The server's agent calls the model as
its model server: the rollout worker's policy endpoint (``streamrl.policy.endpoint``), under
the episode's ``EpisodeId.capture_key``, which is open there only while this attempt runs. Each
turn it answers is recorded with its token ids and log-probs; the trajectory is those turns and
the conversation of the result's ``response``.

An environment server that answers the typed body 422 (``legacy_agent``, which relays ``/run``
to an unmigrated agent whose ``/run`` reads the row) gets the row itself from then on, with the
episode's capture key as its ``_ng_rollout_id`` field.

Attempts. The attempt is checkpointed as ``running`` before ``/run`` is sent. A worker that dies
meanwhile cannot learn the result: the worker that reclaims the sample runs it again as the next
``attempt``; the dead attempt's model calls find no open episode (404), so its agent fails and
its server unwinds (closes its sessions); whatever it answers is never read, so a sample is never
scored twice. A failure with ``terminal: false``, a 5xx, a timeout or a lost answer is the next
attempt too (at most ``retries`` more); ``terminal: true``, a refusal (4xx), or attempts spent:
``EnvUnavailable``, a dead letter, never a reward. ``mask_sample`` in the result is
``SampleMasked`` at the verifier stage, as with ``/verify``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec
import structlog

from streamrl.envs._nemo_gym_http import (
    ResourcesServer,
    _json_object,
    _Malformed,
    snippet,
    verify_answer,
)
from streamrl.envs._nemo_gym_wire import episode_id, resources_session_id
from streamrl.envs.base import EnvUnavailable, OptionError
from streamrl.envs.external import CallUnconfirmed
from streamrl.http import RetryPolicy
from streamrl.responses import items_from_json
from streamrl.schema import Item, ModelTurn, Task

log = structlog.get_logger("streamrl.envs.nemo_gym")


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (port 0: any free port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


class RunClient:
    """mode=run's side of the environment: the environment server's ``/run`` (one try per
    attempt, a retry being the next attempt; the whole episode's timeout), and the address the
    worker serves its policy on."""

    def __init__(self, url: str, o: dict[str, Any]) -> None:
        try:
            self.address = parse_address(str(o["policy_endpoint"]))
        except ValueError as e:
            raise OptionError(f"environment 'nemo-gym' option policy_endpoint: {e}") from None
        self.server = ResourcesServer(
            url,
            RetryPolicy(1, o["backoff_s"], o["backoff_max_s"]),
            timeout_s=o["run_timeout_s"],
            connect_timeout_s=o["connect_timeout_s"],
            max_connections=o["max_connections"],
            # a fresh connection per /run: one the server closed while idle would fail the
            # request after it may have been sent, which costs the episode an attempt
            keepalive=False,
        )
        self.legacy = False  # its /run reads the row (legacy_agent), found on a 422
        self.taskset = str(o["taskset"])
        self.attempts = int(o["retries"]) + 1


class Served(NamedTuple):
    """An episode an environment server drove: the conversation, the recorded model turns and
    the environment's state (the result in ``run_result``)."""

    items: list[Item]
    turns: list[ModelTurn]
    state: Any


def run_answer(body: bytes) -> dict[str, Any]:
    answer = _json_object(body, "the /run answer")
    if not isinstance(answer.get("result"), dict) and not isinstance(answer.get("failure"), dict):
        raise _Malformed("the /run answer has neither a result nor a failure object")
    return answer


def legacy_run_answer(body: bytes) -> dict[str, Any]:
    """What an unmigrated agent's ``/run`` answers: the ``/verify`` answer itself."""
    return {"result": verify_answer(body)}


def run_body(env: Any, client: RunClient, task: Task, attempt: int) -> dict[str, Any]:
    """0.7's ``BaseEpisodeRequest``: the row as ``SingleAgentTurnTaskInput`` reads it."""
    row = env.row(task)
    params = row.pop("responses_create_params")
    return {
        "episode_id": episode_id(task.task_id, attempt),
        "task": {
            "task_id": {"taskset": client.taskset, "task_id": task.prompt_id},
            "task_input": {"responses_create_params": params, "task_data": row},
        },
    }


def legacy_body(env: Any, client: RunClient, task: Task, attempt: int) -> dict[str, Any]:
    """The row, for an agent's legacy ``/run``, with the episode's capture key."""
    return {**env.row(task), "_ng_rollout_id": resources_session_id(task.task_id, attempt)}


def _conversation(task: Task, result: dict[str, Any], fallback: list[Item]) -> list[Item]:
    """The task's input and the result's ``response.output`` (the agent's whole episode, tool
    outputs included); else the longest conversation the endpoint saw."""
    response = result.get("response")
    if isinstance(response, dict):
        try:
            return [*task.input, *items_from_json(response.get("output") or [], "response")]
        except ValueError as e:
            log.warning("the /run result's response cannot be read", error=str(e))
    return fallback or list(task.input)


async def arun(
    env: Any, client: RunClient, task: Task, state: Any, endpoint: Any, save: Any
) -> Served:
    """Run the episode on the environment server (see the module)."""
    j = state.journal
    if state.run_phase == "running":  # the worker running attempt n died: n is given up
        log.warning("redoing an episode whose worker died", task_id=task.task_id, attempt=j.attempt)
        journal = msgspec.structs.replace(j, attempt=j.attempt + 1)
        state = msgspec.structs.replace(state, journal=journal, run_redone=state.run_redone + 1)
    failures: list[str] = []
    while True:
        attempt = state.journal.attempt
        state = msgspec.structs.replace(state, run_phase="running")
        await save(state)  # checkpointed before the request: a kill from here on redoes it
        key = resources_session_id(task.task_id, attempt)
        capture = endpoint.open(key, task)
        try:
            answer, why = await _post(env, client, task, attempt)
        finally:
            endpoint.close(key)
        if answer is not None and isinstance(answer.get("result"), dict):
            result = answer["result"]
            state = msgspec.structs.replace(
                state, run_phase="done", run_result=result, run_failures=failures
            )
            return Served(_conversation(task, result, capture.items), capture.turns, state)
        failure = (answer or {}).get("failure") or {}
        if answer is not None:
            why = (
                f"/run failed at stage {failure.get('stage') or '?'} "
                f"(terminal={failure.get('terminal')!r}, kind={failure.get('failure_kind')!r}): "
                f"{snippet(str(failure.get('failure_reason')))}"
            )
        failures.append(f"attempt {attempt}: {why}")
        terminal = answer is not None and failure.get("terminal") is not False
        if terminal or why.startswith("refused") or len(failures) >= client.attempts:
            raise EnvUnavailable(
                f"{why} ({len(failures)} attempt(s) of episode {task.task_id}; earlier: "
                f"{'; '.join(failures[:-1]) or 'none'})"
            )
        log.warning("retrying an episode as its next attempt", task_id=task.task_id, why=why)
        journal = msgspec.structs.replace(state.journal, attempt=attempt + 1)
        state = msgspec.structs.replace(state, journal=journal)


async def _post(
    env: Any, client: RunClient, task: Task, attempt: int
) -> tuple[dict[str, Any] | None, str]:
    """``POST /run`` once (the typed body; the row to a server known to read only that): its
    answer, or None and why not ("refused..." for a 4xx)."""
    for legacy in (client.legacy, True):
        body = (legacy_body if legacy else run_body)(env, client, task, attempt)
        parse = legacy_run_answer if legacy else run_answer
        try:
            answer = await client.server.apost("/run", body, {}, parse, tool=True, idempotent=False)
        except (CallUnconfirmed, EnvUnavailable) as e:
            return None, str(e)
        if answer.status == 422 and not legacy:  # a /run that reads the row: legacy_agent
            client.legacy = True
            continue
        if answer.status >= 400:
            return None, (
                f"refused: HTTP {answer.status} from POST /run (not retried): "
                f"{snippet(answer.body)}"
            )
        return answer.parsed, ""
    raise AssertionError("unreachable")
