import random

import pytest

from streamrl.envs import make_env
from streamrl.envs.copy import SYMBOLS, CopyEnv
from streamrl.schema import Message, Task, Trajectory


def _task(env: CopyEnv, seed: int = 0) -> Task:
    prompt = env.generate(random.Random(seed), 0)
    return Task(
        task_id="p0:0", prompt_id="p0", k=0, group_size=1, env="copy",
        input=prompt.input, data=prompt.data,
    )  # fmt: skip


def _score(env: CopyEnv, task: Task, text: str) -> float:
    items = [*task.input, Message(role="assistant", content=text)]
    traj = Trajectory(
        task_id=task.task_id, prompt_id=task.prompt_id, k=0, group_size=1, env="copy",
        items=items, turns=[], status="completed",
    )  # fmt: skip
    return env.verify(task, traj, env.reset(task)).reward


def test_registry_and_prompt_shape():
    env = make_env("copy")
    assert isinstance(env, CopyEnv) and env.tools == []
    task = _task(env)
    (msg,) = task.input
    assert msg.role == "user"
    words = msg.content.split()
    assert words[:2] == ["copy", ":"] and len(words) == 5
    assert words[2:] == task.data["answer"]
    assert all(w in SYMBOLS for w in words[2:])


def test_generator_is_seeded_and_uniform():
    env = CopyEnv()
    a = [env.generate(random.Random(7), i).data["answer"] for i in range(3)]
    b = [env.generate(random.Random(7), i).data["answer"] for i in range(3)]
    assert a == b
    rng = random.Random(1)
    seen = {s for i in range(200) for s in env.generate(rng, i).data["answer"]}
    assert seen == set(SYMBOLS)


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        ("{0} {1} {2}", 1.0),
        ("{0} {1} {2} <eos>", 1.0),  # words after the third are ignored
        ("{0} {1} {2} {0} {0}", 1.0),
        ("<bos> {0} {1} {2}", 0.0),  # a stray special token shifts every position
        ("{0} {1}", 2 / 3),  # missing words are wrong
        ("{0} <bos> {2}", 2 / 3),
        ("", 0.0),
        ("  {0}\n{1}\t{2}  ", 1.0),  # any whitespace separates words
    ],
)
def test_reward_is_fraction_of_positions(text, reward):
    env = CopyEnv()
    task = _task(env, seed=3)
    task.data["answer"] = ["a", "b", "c"]
    assert _score(env, task, text.format("a", "b", "c")) == pytest.approx(reward)


def test_wrong_symbols_and_reference():
    env = CopyEnv()
    task = _task(env, seed=5)
    task.data["answer"] = ["p", "p", "a"]
    assert _score(env, task, "p a p") == pytest.approx(1 / 3)
    ref = env.reference(task, list(task.input), env.reset(task))
    assert isinstance(ref, Message) and ref.role == "assistant" and ref.content == "p p a"
    assert _score(env, task, ref.content) == 1.0


def test_symbols_option():
    env = make_env("copy", symbols=5)
    task = _task(env, seed=2)
    assert len(task.data["answer"]) == 5
    assert _score(env, task, " ".join(task.data["answer"][:4])) == pytest.approx(0.8)
