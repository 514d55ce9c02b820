"""NeMo Gym's wire values that ``nemo_gym`` builds and reads: the ``EpisodeId`` and
``resources_session_id`` of a sample's server session (0.7's typed seeds and
``/close_session``), and a ``/verify`` answer as a Verdict (a masked one as ``SampleMasked``)."""

from __future__ import annotations

import json
import re
from typing import Any

from streamrl.defaults import NEMO_GYM_BODY_SNIPPET
from streamrl.envs._nemo_gym_http import Answer, snippet
from streamrl.envs.base import EnvUnavailable, SampleMasked, Verdict
from streamrl.schema import Task

# the request, echoed back in every /verify answer (BaseVerifyResponse extends the request)
_ECHOED_FIELDS = frozenset({"responses_create_params", "response"})

_ROLLOUT_ID_CHAR = re.compile(r"[A-Za-z0-9.-]")


def episode_id(task_id: str, attempt: int) -> dict[str, Any]:
    """NeMo Gym's ``EpisodeId`` of one server session of a sample: ``rollout_id`` is the task
    id written in the characters it allows (any other character, ``_`` included, as ``_`` and
    two hex digits, so that distinct task ids stay distinct; its first character escaped after an
    ``x`` when it is not a letter or digit), ``attempt`` the session's count from 0
    (``Journal.attempt``)."""
    lead = task_id[:1].isascii() and task_id[:1].isalnum()
    out = [] if lead else ["x"]
    for i, ch in enumerate(task_id):
        ok = _ROLLOUT_ID_CHAR.fullmatch(ch) and (i > 0 or lead)
        out.append(ch if ok else "".join(f"_{b:02x}" for b in ch.encode()))
    rollout = "".join(out)
    if re.search(r"-a[1-9][0-9]*$", rollout):  # EpisodeId reserves that suffix
        rollout += "_"
    return {"rollout_id": rollout, "attempt": attempt}


def resources_session_id(task_id: str, attempt: int) -> str:
    """The id streamrl gives a sample's server session: ``EpisodeId.capture_key``."""
    rollout = episode_id(task_id, attempt)["rollout_id"]
    return rollout if attempt == 0 else f"{rollout}-a{attempt}"


def typed_seed_body(task: Task, attempt: int, taskset: str, row: dict[str, Any]) -> dict:
    """NeMo Gym 0.7's ``ResourcesSeedSessionRequest`` for session ``attempt`` of a sample: the
    episode (``rollout_id``: the sample, ``attempt``: its server sessions counted from 0), the
    task (``taskset``, the prompt id: a group's samples share it) and the row as
    ``task_data``."""
    return {
        **close_body(task.task_id, attempt),
        "task_id": {"taskset": taskset, "task_id": task.prompt_id},
        "task_data": row,
    }


def close_body(task_id: str, attempt: int) -> dict[str, Any]:
    """``ResourcesCloseSessionRequest`` of session ``attempt`` of a sample."""
    return {
        "resources_session_id": resources_session_id(task_id, attempt),
        "episode_id": episode_id(task_id, attempt),
    }


def seeds_typed(openapi: Any) -> bool:
    """Whether a server's OpenAPI schema says its ``/seed_session`` takes the typed body."""
    paths = openapi.get("paths") if isinstance(openapi, dict) else None
    seed = paths.get("/seed_session") if isinstance(paths, dict) else None
    return "ResourcesSeedSessionRequest" in json.dumps(seed or {})


def took_typed(answer: Answer, body: dict[str, Any], known_typed: bool) -> bool:
    """Whether a server took the typed seed ``body`` (it echoes ``resources_session_id``). A
    422 (a legacy model with required fields) or no echo (one that ignored the typed fields):
    it reads the legacy body. Another 4xx refuses the request itself; no echo from a server
    ``known_typed`` is a failure too."""
    if 400 <= answer.status < 500 and answer.status != 422:
        raise EnvUnavailable(
            f"HTTP {answer.status} from POST /seed_session (the server refused the request; "
            f"not retried): {snippet(answer.body)}"
        )
    parsed = answer.parsed if answer.status < 400 else None
    took = isinstance(parsed, dict) and (
        parsed.get("resources_session_id") == body["resources_session_id"]
    )
    if not took and known_typed:
        raise EnvUnavailable(
            "/seed_session answered a typed seed without echoing its resources_session_id, "
            f"though this server took typed seeds before: {snippet(answer.body)}"
        )
    return took


def verdict_from_answer(answer: dict[str, Any]) -> Verdict:
    """A /verify answer as a Verdict, every field kept (see the module's docstring)."""
    if answer.get("mask_sample") is True:
        kind = answer.get("failure_kind")
        raise SampleMasked(
            kind if isinstance(kind, str) and kind else "unspecified",
            "/verify masked the sample (its reward is not a valid measurement): "
            f"failure_reason={snippet(str(answer.get('failure_reason')))!r}, "
            f"reward={answer.get('reward')!r}",
        )
    components: dict[str, float] = {}
    details: dict[str, str] = {}
    info: dict[str, Any] = {}
    for key, value in answer.items():
        if key == "reward" or key in _ECHOED_FIELDS:
            continue
        info[key] = value
        if isinstance(value, int | float) and not isinstance(value, bool):
            components[key] = float(value)
        elif isinstance(value, str):
            details[key] = value[:NEMO_GYM_BODY_SNIPPET]
    rc = answer.get("reward_components")
    if isinstance(rc, dict):
        for key, value in rc.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                components[f"reward_components.{key}"] = float(value)
    return Verdict(
        reward=float(answer["reward"]), components=components, details=details, info=info
    )
