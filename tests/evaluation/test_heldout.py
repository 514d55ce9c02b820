"""``streamrl eval``: the pass@k estimator, the held-out split against what the producer really
pushes, and the evaluation itself on a tiny random model with the real hf backend, episode
loop and ``copy`` verifier."""

from __future__ import annotations

import itertools
import json
import random
import statistics

import msgspec
import pytest

import streamrl.policy.hf as hf
from streamrl.bus.keys import Keys
from streamrl.envs import make_env
from streamrl.evaluation.estimators import bootstrap_ci, ks_for, pass_at_k
from streamrl.evaluation.heldout import EvalError, evaluate, heldout_prompts
from streamrl.evaluation.spec import EvalSpec
from streamrl.models.tiny import save_tiny
from streamrl.producer.produce import Producer
from streamrl.schema import TASK
from tests.support.cli import run_cli


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")


# ---------------------------------------------------------------- the numbers


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Every k-subset of n samples (the first c correct): the fraction with a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_enumerated_probability():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)
    assert pass_at_k(8, 2, 1) == 0.25
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_ks_are_powers_of_two_and_k():
    assert ks_for(1) == [1]
    assert ks_for(8) == [1, 2, 4, 8]
    assert ks_for(6) == [1, 2, 4, 6]


def test_bootstrap_interval_matches_the_normal_one_on_a_large_sample():
    rng = random.Random(0)
    values = [float(rng.random() < 0.3) for _ in range(2000)]
    mean = statistics.fmean(values)
    half = 1.96 * statistics.stdev(values) / len(values) ** 0.5
    lo, hi = bootstrap_ci(values, seed=1)
    assert lo == pytest.approx(mean - half, abs=0.004)
    assert hi == pytest.approx(mean + half, abs=0.004)
    assert bootstrap_ci(values, seed=1) == (lo, hi)  # seeded
    assert bootstrap_ci([0.5] * 10) == (0.5, 0.5)


# ---------------------------------------------------------------- the held-out split


def test_heldout_prompts_are_never_training_prompts(r, run_name):
    """Against what ``Producer.from_env`` really pushes: by input and by data, for the same
    seed. ``copy`` has only 4096 prompts, so many candidates collide with training prompts
    and must be excluded (which the test checks happened)."""
    env = make_env("copy")
    seed, trained = 3, 2000
    Producer(r, run_name).from_env(env, trained, group_size=1, seed=seed)
    pushed = [TASK.decode(f[b"p"]) for _, f in r.xrange(Keys(run_name).tasks)]
    assert len(pushed) == trained
    train_inputs = {msgspec.json.encode(t.input) for t in pushed}
    train_data = {json.dumps(t.data, sort_keys=True) for t in pushed}

    held = heldout_prompts(env, 300, seed=seed, train_prompts=trained)
    assert len(held.tasks) == 300
    assert held.excluded_seen > 0  # a separate rng derivation alone would have overlapped
    inputs = [msgspec.json.encode(t.input) for t in held.tasks]
    data = [json.dumps(t.data, sort_keys=True) for t in held.tasks]
    assert not set(inputs) & train_inputs
    assert not set(data) & train_data
    assert len(set(inputs)) == len(inputs)  # distinct among themselves
    assert not {t.prompt_id for t in held.tasks} & {t.prompt_id for t in pushed}

    # a pure function of its arguments, and a smaller count is a prefix
    again = heldout_prompts(env, 40, seed=seed, train_prompts=trained)
    assert [t.prompt_id for t in again.tasks] == [t.prompt_id for t in held.tasks[:40]]


def test_a_prompt_space_too_small_is_refused():
    env = make_env("kayles")  # a few dozen distinct prompts
    with pytest.raises(EvalError, match="too few unseen prompts"):
        heldout_prompts(env, 50, seed=0, train_prompts=2000)


# ---------------------------------------------------------------- evaluating


def test_evaluate_reports_what_the_samples_scored(tiny_dir, monkeypatch):
    batches: list[int] = []
    generate = hf.HFPolicy._generate

    def spy(self, batch):
        batches.append(len(batch))
        return generate(self, batch)

    monkeypatch.setattr(hf.HFPolicy, "_generate", spy)
    seen: dict[str, list[float]] = {}

    def on_sample(task, trajectory, verdict):
        assert trajectory.status == "completed" and trajectory.turns
        seen.setdefault(task.prompt_id, []).append(verdict.reward)

    threshold = 1 / 3  # one word of three: a random model passes sometimes
    spec = EvalSpec(
        env="copy",
        model=str(tiny_dir),
        prompts=6,
        k=4,
        max_new_tokens=6,
        pass_reward=threshold,
        train_prompts=500,
    )
    report = evaluate(spec, on_sample=on_sample)
    assert max(batches) > 1  # concurrent episodes share generate calls
    assert sum(batches) == report.samples == 24
    assert report.prompts == 6 and report.k == 4 and len(seen) == 6
    assert all("-heldout-" in pid and len(rs) == 4 for pid, rs in seen.items())
    rewards = [x for rs in seen.values() for x in rs]
    assert report.mean_reward == pytest.approx(statistics.fmean(rewards))
    passes = [sum(x >= threshold - 1e-9 for x in seen[p.prompt_id]) for p in report.per_prompt]
    assert [p.passed for p in report.per_prompt] == passes
    assert 0 < sum(passes) < 24, passes  # both outcomes occur, so the check below means something
    assert sorted(report.pass_at_k) == [1, 2, 4]
    for k, value in report.pass_at_k.items():
        brute = statistics.fmean(brute_pass_at_k(4, c, k) for c in passes)
        assert value == pytest.approx(brute)
        lo, hi = report.pass_at_k_ci[k]
        assert 0 <= lo <= value <= hi <= 1
    assert report.pass_at_1 == pytest.approx(sum(passes) / 24)


def test_weights_are_a_published_policy_version(tiny_dir, tmp_path):
    """``--weights policy/v3`` (a full state dict) samples exactly what that model samples."""
    other = save_tiny(tmp_path / "policy" / "v3", seed=1)  # model.safetensors + tokenizer
    tokens: dict[str, list] = {}

    def run(name, model, weights=None):
        got = tokens.setdefault(name, [])
        spec = EvalSpec(
            env="copy",
            model=str(model),
            weights=weights,
            prompts=2,
            k=2,
            max_new_tokens=6,
            train_prompts=0,
        )
        return evaluate(
            spec,
            on_sample=lambda task, traj, verdict: got.append(
                (task.task_id, traj.turns[0].token_ids)
            ),
        )

    loaded = run("loaded", tiny_dir, str(other))
    run("direct", other)
    run("base", tiny_dir)
    assert loaded.policy_version == 3 and loaded.weights == str(other.resolve())
    assert sorted(tokens["loaded"]) == sorted(tokens["direct"])
    assert sorted(tokens["loaded"]) != sorted(tokens["base"])
    with pytest.raises(EvalError, match="not a policy version"):
        evaluate(EvalSpec(env="copy", model=str(tiny_dir), weights=str(tmp_path), prompts=1, k=1))


# ---------------------------------------------------------------- the command


def test_eval_command_prints_a_json_report(tiny_dir, tmp_path, subprocess_env):
    config = tmp_path / "run.toml"
    config.write_text(
        'env = "copy"\n[policy]\nbackend = "hf"\nmodel = "elsewhere"\n'
        "temperature = 0.7\nmax_new_tokens = 5\n"
    )
    argv = ["eval", "--config", str(config), "--model", str(tiny_dir)]  # --model wins
    done = run_cli([*argv, "--prompts", "4", "--k", "2", "--seed", "1", "--json"], subprocess_env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["env"] == "copy" and report["prompts"] == 4 and report["k"] == 2
    assert report["samples"] == 8 and len(report["per_prompt"]) == 4
    assert report["max_new_tokens"] == 5 and report["temperature"] == 0.7  # from [policy]
    assert report["model"] == str(tiny_dir)
    assert report["pass_reward"] == 1.0 and report["seed"] == 1
    assert sorted(report["pass_at_k"]) == ["1", "2"] == sorted(report["pass_at_k_ci"])
    lo, hi = report["pass_at_1_ci"]
    assert 0 <= lo <= report["pass_at_1"] <= hi <= 1
    assert 0 <= report["mean_reward"] <= 1 and report["samples_per_s"] > 0
    assert "bootstrap" in report["ci_method"]


def _config(tmp_path, model: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(f'env = "copy"\n[policy]\nbackend = "hf"\nmodel = "{model}"\n')
    return str(path)


@pytest.mark.parametrize(
    ("argv", "status", "says"),
    [
        (["--env", "copy", "--model", "no/such/model"], 2, "no such directory"),
        (["--config", "{config}"], 1, "policy.model = 'no/such/model': no such directory"),
        (["--env", "copy", "--model", "{tiny}", "-o", "nope=1"], 2, "has no option 'nope'"),
        (["--env", "copy", "--model", "{tiny}", "-o", "symbols=0"], 2, "symbols=0"),
        (["--env", "no_such_env", "--model", "{tiny}"], 2, "unknown environment 'no_such_env'"),
        (["--env", "copy", "--model", "{tiny}", "--weights", "{tmp}"], 2, "not a policy version"),
        (["--model", "{tiny}"], 2, "give --env NAME or --config"),
        (["--env", "copy", "--model", "{tiny}", "--k", "0"], 2, "'--k'"),
    ],
    ids=["model-missing", "config-model-missing", "option-unknown", "option-range", "env",
         "weights", "no-env", "k-zero"],
)  # fmt: skip
def test_bad_input_gets_one_error_line(argv, status, says, tiny_dir, tmp_path, subprocess_env):
    fill = {
        "tiny": str(tiny_dir),
        "tmp": str(tmp_path),
        "config": _config(tmp_path, "no/such/model"),
    }
    done = run_cli(["eval", *(a.format(**fill) for a in argv)], subprocess_env)
    out = done.stdout + done.stderr
    assert done.returncode == status, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and says in errors[0], out


def test_a_masked_sample_leaves_its_prompt_out_of_eval_never_a_zero():
    """A sample the environment masked (NeMo Gym's ``mask_sample``) is not a measurement: its
    prompt is left out of pass@k and the mean, counted by kind; all masked is an error."""
    from streamrl import schema
    from streamrl.envs import SampleMasked, Verdict
    from streamrl.evaluation.heldout import _rewards_by_prompt

    tasks = [schema.Task(task_id=f"{p}:{k}", prompt_id=p, k=k, group_size=2, env="copy",
                         input=[]) for p in ("a", "b") for k in range(2)]  # fmt: skip
    one, masked = Verdict(reward=1.0), SampleMasked("judge_failed", "the judge is down")
    scored = [(None, one), (None, one), (None, masked), (None, Verdict(reward=0.0))]
    by_prompt, kinds = _rewards_by_prompt(tasks, scored)
    assert by_prompt == [("a", [1.0, 1.0])] and kinds == {"judge_failed": 1}
    with pytest.raises(EvalError, match="masked"):
        _rewards_by_prompt(tasks[2:], [*scored[2:3], (None, masked)])
