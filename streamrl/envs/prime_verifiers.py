"""``verifiers``: a PrimeIntellect ``verifiers`` 0.4 environment (``import verifiers.v1 as vf``)
as a streamrl environment. Its taskset's tasks are the prompts, its own harness drives each
episode inside the rollout worker with the worker's policy as the model, and its task's reward
functions score the episode in the verifier worker.

- **Tasks**: ``generate`` takes the taskset's task ``index`` (modulo its length when it is
  finite); the prompt is the task's system prompt and prompt, and the task's data (verifiers'
  ``TaskData``, as JSON) rides in ``Task.data["vf"]``, so any worker rebuilds the task from it.
- **An episode** is ``Env.run_episode(task, ModelContext)`` in the rollout worker's process, its
  scoring deferred (``Task.defer_scoring``): the harness's program reaches "the model" through
  verifiers' interception server, whose upstream (an ``EvalClientConfig`` ``base_url``) is the
  worker's policy endpoint (``streamrl.policy.endpoint``) under the episode's key,
  ``.../episodes/<key>/v1``, open only while its attempt runs. Each model turn is recorded there
  with its token ids and log-probs; the trajectory is the conversation the endpoint saw. The
  finished traces (verifiers' ``Trace`` JSON, and each trace's ``state`` JSON, which verifiers
  leaves out of a trace's serialization) are the environment state.
- **Scoring** (verifier worker): the task's ``@vf.reward`` / ``@vf.metric`` functions and
  plugged judges (``Task.score(trace)``, without a runtime), on top of rewards the ``Env``'s
  own ``run()`` recorded on the trace (a game's outcome). A reward or judge that needs the
  episode's runtime (its sandbox: files the agent wrote) cannot run there: such a sample is a
  verifier failure, dead-lettered, never a partial sum; a metric that needs it is skipped, as
  verifiers skips it offline. The reward is ``Trace.reward`` (the
  weighted sum), averaged over the episode's traces; each reward and metric is kept in
  ``Score.info`` and ``components`` (``reward.<name>``, ``metric.<name>``).
- **Attempts**: the attempt is checkpointed as *running* before the episode starts. A worker
  that dies meanwhile cannot resume it (verifiers has no entry point that continues an episode
  from saved state and a harness's program dies with the worker): the worker that reclaims the
  sample redoes it from the start as the next attempt; the dead attempt's key is closed on the
  endpoint, so nothing it produced is recorded or scored. An episode that ends with errors
  (``Episode.ok`` false) is redone as the next attempt, at most ``retries`` more, then
  dead-lettered with verifiers' errors: a failure, never a reward.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import threading
from typing import Annotated, Any

import msgspec
import structlog

from streamrl.envs._nemo_gym_run import Served, parse_address
from streamrl.envs.base import Environment, EnvUnavailable, OptionError, Prompt
from streamrl.schema import Item, Message, Task, Trajectory
from streamrl.verifiers.verdict import Verdict

log = structlog.get_logger("streamrl.envs.verifiers")

# the model client's API key variable: the endpoint names the episode by its path, so the key
# is not checked; verifiers reads the variable when it builds its client
API_KEY_VAR = "STREAMRL_VERIFIERS_API_KEY"


class VerifiersState(msgspec.Struct, kw_only=True):
    attempt: int = 0
    phase: str = ""  # "running" while an attempt is in flight, "done" once it finished
    redone: int = 0  # attempts redone because the worker running them died
    failures: list[str] = msgspec.field(default_factory=list)
    traces: list[str] = msgspec.field(default_factory=list)  # verifiers Trace JSON
    trace_states: list[str] = msgspec.field(default_factory=list)  # each trace's state JSON


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise OptionError(
            "environment 'verifiers' needs PrimeIntellect verifiers 0.4 "
            f"(pip install 'verifiers==0.4.0'): {e}"
        ) from None
    return vf


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    from verifiers.v1.types import content_text

    return content_text(content)


def _run(coro: Any) -> Any:
    """Run a coroutine to its end from synchronous code (the verifier worker), on a thread of
    its own when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(("ok", asyncio.run(coro)))
        except BaseException as e:  # handed back to the caller
            out.append(("err", e))

    t = threading.Thread(target=target)
    t.start()
    t.join()
    kind, value = out[0]
    if kind == "err":
        raise value
    return value


class VerifiersEnv(Environment[VerifiersState]):
    name = "verifiers"
    verifier_name = "verifiers"
    State = VerifiersState
    tools = []  # the harness's own tools: the model sees them in its requests to the endpoint
    serves_episodes = True

    class Options(msgspec.Struct, kw_only=True):
        taskset: str = ""  # a taskset id: a shipped one (nemo_gym, textarena...) or a package's
        # the taskset's config (``--env.taskset.*`` of ``vf-eval``): dataset, task: {...}...
        taskset_args: dict[str, Any] = msgspec.field(default_factory=dict)
        env_id: str = ""  # a paired Env (best-of-n...); default: the taskset's own
        harness: str = "null"  # the agent's harness; "" keeps the taskset's default (bash)
        harness_args: dict[str, Any] = msgspec.field(default_factory=dict)
        runtime: str = "subprocess"  # where the harness's program runs (verifiers' default: prime)
        env_args: dict[str, Any] = msgspec.field(default_factory=dict)  # other EnvConfig fields
        policy_endpoint: str = "127.0.0.1:0"  # where the worker serves its policy
        model: str = "streamrl"
        retries: Annotated[int, msgspec.Meta(ge=0, le=20)] = 2
        verifier_version: str = "1"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o = self.options
        if not o["taskset"]:
            raise OptionError(
                "environment 'verifiers' needs a taskset id: --env-option taskset=nemo_gym "
                "(and its config as taskset_args={...})"
            )
        try:
            self.endpoint_address = parse_address(str(o["policy_endpoint"]))
        except ValueError as e:
            raise OptionError(f"environment 'verifiers' option policy_endpoint: {e}") from None
        self._config: Any = None
        self._env: Any = None
        self._tasks: list[Any] | None = None
        self._serving: contextlib.AsyncExitStack | None = None
        self._serving_lock: asyncio.Lock | None = None

    @property
    def verifier_id(self) -> tuple[str, str]:
        return (self.verifier_name, f"{self.options['taskset']}/{self.options['verifier_version']}")

    # ------------------------------------------------------------------ verifiers objects
    def env_config(self) -> Any:
        """verifiers' ``EnvConfig`` for the options (validated by verifiers itself)."""
        if self._config is None:
            _vf()
            from verifiers.v1.utils.loaders import resolve_env_config

            o = self.options
            agent: dict[str, Any] = {"runtime": {"type": o["runtime"]}}
            if o["harness"]:
                agent["harness"] = {"id": o["harness"], **o["harness_args"]}
            raw = {
                **o["env_args"],
                "taskset": {"id": o["taskset"], **o["taskset_args"]},
                "agent": {**agent, **o["env_args"].get("agent", {})},
            }
            if o["env_id"]:
                raw["id"] = o["env_id"]
            try:
                self._config = resolve_env_config(raw)
            except Exception as e:
                raise OptionError(f"environment 'verifiers': {type(e).__name__}: {e}") from None
        return self._config

    def vf_env(self) -> Any:
        if self._env is None:
            _vf()
            from verifiers.v1.utils.loaders import load_environment

            self._env = load_environment(self.env_config())
        return self._env

    def task_class(self) -> Any:
        _vf()
        from verifiers.v1.utils.loaders import task_type

        return task_type(self.options["taskset"])

    def vf_task(self, task: Task) -> Any:
        """The verifiers task a streamrl task carries (its data, the taskset's task config)."""
        cls = self.task_class()
        data = cls.data_type().model_validate(task.data["vf"])
        return cls(data, self.env_config().taskset.task)

    # ------------------------------------------------------------------ tasks
    def generate(self, rng: random.Random, index: int) -> Prompt:
        if self._tasks is None:
            taskset = self.vf_env().taskset
            self._tasks = list(taskset) if taskset.bounded else []
            self._infinite = None if taskset.bounded else taskset
        if self._tasks:
            vf_task = self._tasks[index % len(self._tasks)]
        else:  # an infinite taskset (textarena): its task at ``index``
            vf_task = next(iter(self._infinite.skip(index).take(1)))
        data = vf_task.data
        items: list[Item] = []
        if data.system_prompt:
            items.append(Message(role="system", content=data.system_prompt))
        if isinstance(data.prompt, str):
            items.append(Message(role="user", content=data.prompt))
        else:
            for m in data.prompt or []:
                role = m.role if m.role in ("system", "developer", "user", "assistant") else "user"
                items.append(Message(role=role, content=_text(m.content)))
        return Prompt(items, {"vf": data.model_dump(mode="json", exclude_none=True)})

    def same_prompt_key(self, prompt: Prompt) -> Any:
        return json.dumps(prompt.data["vf"], sort_keys=True)

    def reset(self, task: Task) -> VerifiersState:
        return VerifiersState()

    # ------------------------------------------------------------------ the episode
    async def _serving_env(self) -> Any:
        """The verifiers ``Env`` inside its ``serving()`` context (its interception server and
        shared tool servers), entered once per worker lease, left in ``aclose``."""
        if self._serving_lock is None:
            self._serving_lock = asyncio.Lock()
        async with self._serving_lock:
            env = self.vf_env()
            if self._serving is None:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(env.serving())
                self._serving = stack
        return env

    async def aclose(self) -> None:
        self._serving_lock = None  # bound to this lease's event loop
        if self._serving is not None:
            stack, self._serving = self._serving, None
            await stack.aclose()

    async def arun_served(
        self, task: Task, state: VerifiersState, endpoint: Any, save: Any
    ) -> Served:
        vf = _vf()
        env = await self._serving_env()
        os.environ.setdefault(API_KEY_VAR, "streamrl")
        if state.phase == "running":  # the worker running this attempt died: it is given up
            log.warning("redoing an episode whose worker died", task_id=task.task_id,
                        attempt=state.attempt)  # fmt: skip
            state = msgspec.structs.replace(
                state, attempt=state.attempt + 1, redone=state.redone + 1
            )
        failures = list(state.failures)
        while True:
            state = msgspec.structs.replace(state, phase="running", failures=failures)
            await save(state)  # checkpointed before the episode: a kill from here on redoes it
            key = f"vf.{task.task_id}.{state.attempt}".replace(":", ".").replace("/", ".")
            capture = endpoint.open(key, task)
            ctx = vf.ModelContext(
                model=str(self.options["model"]),
                client=vf.EvalClientConfig(
                    base_url=f"{endpoint.url}/episodes/{key}/v1", api_key_var=API_KEY_VAR
                ),
            )
            try:
                episode = await env.run_episode(self.vf_task(task).defer_scoring(), ctx)
                why = "; ".join(f"{e.type}: {e.message}" for e in episode.errors)
                ok = episode.ok and not why
            except Exception as e:  # verifiers' own machinery failed
                episode, ok, why = None, False, f"{type(e).__name__}: {e}"
            finally:
                endpoint.close(key)
            if ok and episode is not None:
                state = msgspec.structs.replace(
                    state,
                    phase="done",
                    failures=failures,
                    traces=[t.model_dump_json() for t in episode.traces],
                    trace_states=[_state_json(t) for t in episode.traces],
                )
                return Served(capture.items or list(task.input), capture.turns, state)
            failures.append(f"attempt {state.attempt}: {why or 'the episode did not end ok'}")
            if len(failures) > self.options["retries"]:
                raise EnvUnavailable(
                    f"verifiers episode failed {len(failures)} time(s): {'; '.join(failures)}"
                )
            log.warning("retrying a verifiers episode as its next attempt",
                        task_id=task.task_id, why=why)  # fmt: skip
            state = msgspec.structs.replace(state, attempt=state.attempt + 1)

    # ------------------------------------------------------------------ scoring
    def verify(self, task: Task, trajectory: Trajectory, state: VerifiersState) -> Verdict:
        _vf()
        from verifiers.v1.state import State as VfState
        from verifiers.v1.trace import Trace
        from verifiers.v1.utils.generic import concrete_type

        if not state.traces:
            raise ValueError("the episode carries no verifiers trace")
        cls = self.task_class()
        state_cls = concrete_type(cls, VfState) or VfState
        rewards: dict[str, float] = {}
        weights: dict[str, float] = {}
        metrics: dict[str, float] = {}
        total = 0.0
        infos: list[dict[str, Any]] = []
        vf_task = self.vf_task(task)
        needs_runtime = _runtime_signals(vf_task)
        if needs_runtime:  # scored without them, the reward would be a silent partial sum
            raise ValueError(
                f"the task's reward functions {needs_runtime} need the episode's runtime "
                "(its sandbox), which the verifier worker does not have"
            )
        for raw, raw_state in zip(state.traces, state.trace_states, strict=True):
            trace = Trace.model_validate_json(raw)
            if raw_state:
                trace.state = state_cls.model_validate_json(raw_state)
            _run(self.vf_task(task).score(trace))
            total += float(trace.reward)
            for name, r in trace.rewards.items():
                if r is not None:
                    rewards[name] = rewards.get(name, 0.0) + float(r.score)
                    weights[name] = float(r.weight)
            for name, m in trace.metrics.items():
                if m is not None:
                    metrics[name] = metrics.get(name, 0.0) + float(m)
            infos.append(json.loads(json.dumps(trace.info, default=str)))
        n = len(state.traces)
        components = {f"reward.{k}": v / n for k, v in rewards.items()}
        components |= {f"metric.{k}": v / n for k, v in metrics.items()}
        info = {
            "rewards": {k: {"score": v / n, "weight": weights[k]} for k, v in rewards.items()},
            "metrics": {k: v / n for k, v in metrics.items()},
            "trace_info": infos if n > 1 else infos[0],
            "attempt": state.attempt,
            "redone": state.redone,
        }
        return Verdict(reward=total / n, components=components, info=info)

    def reference(self, task: Task, items: list[Item], state: VerifiersState) -> Item:
        """No reference agent: verifiers tasks carry no reference answer in general. The
        scripted policy answers with this fixed message (the pipeline's tests)."""
        return Message(role="assistant", content="I am done.")


def _runtime_signals(vf_task: Any) -> list[str]:
    """The task's rewards and judges that take the episode's ``runtime`` (no default)."""
    import inspect

    def needs(fn: Any) -> bool:
        param = inspect.signature(fn).parameters.get("runtime")
        return param is not None and param.default is inspect.Parameter.empty

    out = [fn.__name__ for fn in vf_task.hooks("reward") if needs(fn)]
    return out + [j.reward_name for j in vf_task.plugged_judges() if needs(j.score)]


def _state_json(trace: Any) -> str:
    state = getattr(trace, "state", None)
    if state is None or not hasattr(state, "model_dump_json"):
        return ""
    try:
        return state.model_dump_json()
    except Exception as e:  # a state holding something that is not JSON: scored without it
        log.warning("a verifiers trace state cannot be serialized", error=str(e))
        return ""
