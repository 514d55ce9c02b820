import pytest

from streamrl.envs import make_env
from streamrl.schema import FunctionCall, Message


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_reference_takes_steps_plus_one_turns_and_scores_one(episode, steps):
    env = make_env("counter", steps=steps)
    task = episode.make_task(env, seed=steps)
    trajectory, state = episode.play(env, task, env.reference)
    turns = [i for i in trajectory.items if isinstance(i, FunctionCall | Message)][1:]
    assert len(turns) == steps + 1
    assert env.verify(task, trajectory, state).reward == 1.0


def test_single_turn_prompt_asks_only_for_the_value(episode):
    env = make_env("counter", steps=0)
    task = episode.make_task(env, seed=4)
    assert "add tool" not in task.input[0].content
    start = str(task.data["start"])
    trajectory, state = episode.play(env, task, episode.say(start))
    assert env.verify(task, trajectory, state).reward == 1.0
    trajectory, state = episode.play(env, task, episode.say(start + "1"))
    assert env.verify(task, trajectory, state).reward == 0.0
