"""Weighted mixtures: the drawn proportions match the weights, the draw is reproducible, a
group never mixes environments, changes in Redis reach the next batch, datasets run out."""

from __future__ import annotations

import json
import math
from collections import Counter

import msgspec
import pytest

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.config import EnvEntry, Mixture, RunConfig, load_toml
from streamrl.producer import mixture
from streamrl.producer.mixture import MixedProducer
from streamrl.producer.produce import Producer

WEIGHTS = {"counter": 0.5, "copy": 0.3, "math": 0.2}


def _mix(weights: dict[str, float]) -> Mixture:
    return Mixture(envs=[EnvEntry(env=n, weight=w) for n, w in weights.items()])


def _tasks(r, run: str) -> list[schema.Task]:
    return [schema.TASK.decode(f[b"p"]) for _, f in r.xrange(Keys(run).tasks)]


def _produce(r, run: str, mix: Mixture, count: int, group_size: int = 1, seed: int = 7, **kw):
    mixture.ensure(r, run, mix)
    mp = MixedProducer(Producer(r, run, batch_samples=64), run, group_size, seed, **kw)
    return mp, mp.run_until(count)


def test_drawn_proportions_match_the_weights_and_the_draw_repeats(r, run_name):
    n = 600
    mp, res = _produce(r, run_name, _mix(WEIGHTS), n)
    assert res.prompts == n
    drawn = Counter(t.env for t in _tasks(r, run_name))
    assert drawn == Counter(mp.drawn)
    for name, w in WEIGHTS.items():  # 4 binomial standard deviations: fails ~1 in 16 000
        sd = math.sqrt(n * w * (1 - w))
        assert abs(drawn[name] - n * w) <= 4 * sd, (name, drawn[name], n * w, sd)
    print("drawn vs configured:", {k: (drawn[k] / n, WEIGHTS[k]) for k in WEIGHTS})
    # the same seed draws the same sequence; another seed another one
    _produce(r, run_name + "-again", _mix(WEIGHTS), n)
    _produce(r, run_name + "-other", _mix(WEIGHTS), n, seed=8)
    order = [t.prompt_id for t in _tasks(r, run_name)]
    assert order == [t.prompt_id for t in _tasks(r, run_name + "-again")]
    assert [t.env for t in _tasks(r, run_name)] != [t.env for t in _tasks(r, run_name + "-other")]


def test_a_group_never_mixes_environments_and_a_restart_resumes(r, run_name):
    _produce(r, run_name, _mix(WEIGHTS), 20, group_size=3)
    _, res = _produce(r, run_name, _mix(WEIGHTS), 30, group_size=3)  # a restarted producer
    assert (res.skipped, res.prompts) == (20, 10)
    by_prompt: dict[str, set[str]] = {}
    for t in _tasks(r, run_name):
        by_prompt.setdefault(t.prompt_id, set()).add(t.env)
        assert t.prompt_id.startswith(t.env + "-")
    assert len(by_prompt) == 30 and all(len(envs) == 1 for envs in by_prompt.values())


def test_a_change_in_redis_reaches_the_next_batch(r, run_name):
    """Removed and paused environments are drawn no more, an added one is, from the next batch
    on; the stored mixture wins over the config that first wrote it."""
    calls = []

    def between_batches() -> None:
        calls.append(1)
        if len(calls) == 2:  # after the first batch (16 prompts)
            mixture.update(r, run_name, lambda m: m.envs.append(EnvEntry(env="nim", weight=1)))
            mixture.update(r, run_name, lambda m: setattr(m.envs[0], "removed", True))
            mixture.pause(r, run_name, "copy", "paused by the test")

    mixture.ensure(r, run_name, _mix(WEIGHTS))
    p = Producer(r, run_name, batch_samples=16)
    MixedProducer(p, run_name, 1, 7, on_batch=between_batches).run_until(64)
    envs = [t.env for t in _tasks(r, run_name)]
    assert "nim" not in envs[:16] and set(envs[16:]) == {"math", "nim"}
    assert mixture.ensure(r, run_name, _mix({"copy": 1})).version == 2  # not overwritten


def test_dataset_entries_run_out_and_bad_rows_are_dead_lettered(r, run_name, tmp_path):
    rows = tmp_path / "qa.jsonl"
    lines = [json.dumps({"prompt": f"q{i}", "id": f"r{i}"}) for i in range(4)]
    rows.write_text("\n".join([*lines[:2], "{not json", *lines[2:]]) + "\n")
    mix = Mixture(
        envs=[
            EnvEntry(name="qa", env="chat", dataset=str(rows), weight=3),
            EnvEntry(env="counter", weight=1),
        ]
    )
    _, res = _produce(r, run_name, mix, 40)
    qa = [t for t in _tasks(r, run_name) if t.env == "qa"]
    assert sorted(t.prompt_id for t in qa) == ["qa-r0", "qa-r1", "qa-r2", "qa-r3"]
    assert len(res.rejected) == 1 and "qa.jsonl:3" in res.rejected[0]
    assert int(r.hget(Keys(run_name).mix_rows, "qa")) == 5


def test_envs_tables_decode_and_bad_ones_are_one_line(tmp_path):
    path = tmp_path / "mix.toml"
    path.write_text(
        'run = "m"\ngroup_size = 2\n'
        '[[envs]]\nenv = "counter"\nweight = 0.7\n'
        '[[envs]]\nname = "hard-math"\nenv = "math"\nweight = 0.3\n'
        "[envs.env_options]\nlevel = 3\n"
        "[envs.tripwires]\nwindow = 8\ncanary_every = 10\n"
    )
    cfg = load_toml(path)
    assert [(e.name, e.weight) for e in cfg.mixture().envs] == [
        ("counter", 0.7),
        ("hard-math", 0.3),
    ]
    assert cfg.envs[1].tripwires.window == 8
    assert RunConfig(env="copy").mixture().envs[0].name == "copy"  # the single-env form
    cases = {
        '[[envs]]\nenv = "copy"\n[[envs]]\nenv = "copy"\n': "used twice",
        '[[envs]]\nenv = "copy"\nweight = 0\n': "every weight is 0",
        '[env_options]\nx = 1\n[[envs]]\nenv = "copy"\n': "in each [[envs]] table",
        '[[envs]]\nenv = "copy"\nweight = -1\n': "Expected `float` >= 0",
    }
    for text, message in cases.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=message.replace("[", r"\[")):
            load_toml(path)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(_mix(WEIGHTS)), type=Mixture)
