"""``streamrl export``: NeMo Gym rollout rows, and SFT/DPO chat datasets that ``datasets`` loads
and TRL's SFTTrainer and DPOTrainer train on as they are (one step each, tiny model)."""

from __future__ import annotations

import json

import pytest

from streamrl import schema
from streamrl.config import PolicyConfig, RunConfig
from streamrl.envs import make_env
from streamrl.local.pipeline import LocalPipeline, xrange_all
from streamrl.producer.produce import Producer
from tests.support.cli import run_cli


@pytest.fixture
def scored_run(redis_url, subprocess_env, tmp_path):
    """A counter run with reward variance inside groups: 8 prompts x 4 samples."""
    cfg = RunConfig(run="exp", env="counter", group_size=4, policy=PolicyConfig(wrong_rate=0.5))
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        p.start_workers(1, 1)
        Producer(p.r, "exp").from_env(make_env("counter"), 8, 4, seed=5)
        p.wait_groups(8)
        groups = [(eid.decode(), schema.GROUP.decode(f[b"p"])) for eid, f in
                  xrange_all(p.r, p.keys.groups)]  # fmt: skip
    env = {**subprocess_env, "STREAMRL_REDIS_URL": redis_url, "STREAMRL_RUN": "exp"}
    return groups, env


def _export(env, tmp_path, *args: str) -> tuple[list[dict], dict]:
    out = tmp_path / f"export-{len(list(tmp_path.iterdir()))}.jsonl"
    res = run_cli(["export", *args, "-o", str(out)], env)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stderr.strip().splitlines()[-1])
    return [json.loads(line) for line in out.read_text().splitlines()], summary


def test_export_formats_and_filters(scored_run, tmp_path):
    groups, env = scored_run
    samples = [s for _, g in groups for s in g.samples]
    rows, summary = _export(env, tmp_path, "--format", "nemo-gym")
    assert summary["rows"] == len(rows) == len(samples) == 32
    by_task = {s.trajectory.task_id: s for s in samples}
    for row in rows:
        s = by_task[row["streamrl"]["task_id"]]
        assert row["reward"] == s.score.reward
        assert row["responses_create_params"]["input"][0]["role"] == "user"
        assert [t["name"] for t in row["responses_create_params"]["tools"]] == ["add"]
        kinds = [o["type"] for o in row["response"]["output"]]
        assert kinds[-1] == "message" and "function_call_output" in kinds
        assert row["response"]["output"][-1]["content"][0]["type"] == "output_text"
        assert row["start"] == s.trajectory.data["start"]  # the row's own fields
        assert row["id"] == s.trajectory.prompt_id  # generated prompts: their prompt id
        assert row["response"]["parallel_tool_calls"] is True  # the default, not set by the row
    # NeMo Gym's rollout keys: one task index per prompt, rollouts 0..3 of each, none twice
    keys = {(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows}
    assert keys == {(t, k) for t in range(8) for k in range(4)}
    by_prompt = {r["_ng_task_index"]: r["streamrl"]["prompt_id"] for r in rows}
    assert all(by_prompt[r["_ng_task_index"]] == r["streamrl"]["prompt_id"] for r in rows)
    rewards = sorted({r["reward"] for r in rows})
    assert rewards == [0.0, 1.0]
    # NeMo Gym 0.7's keys: the environment server (aggregation groups by it), the agent, the
    # result type; no token fields, as the scripted policy records none (never a partial set)
    for row in rows:
        assert row["_ng_environment_server"] == "streamrl" and row["agent_ref"] == {
            "name": "streamrl"
        }
        assert row["_ng_result_type"] == "legacy_agent"
        assert not any("generation_token_ids" in o for o in row["response"]["output"])
    named, _ = _export(env, tmp_path, "--format", "nemo-gym", "--nemo-gym-server", "my_env")
    assert {r["_ng_environment_server"] for r in named} == {"my_env"}

    # filters: minimum reward, policy versions (the scripted policy is version 0), offsets
    ones, _ = _export(env, tmp_path, "--format", "nemo-gym", "--min-reward", "1")
    assert len(ones) == sum(1 for s in samples if s.score.reward == 1.0)
    none, summary = _export(env, tmp_path, "--format", "nemo-gym", "--min-policy-version", "1")
    assert none == [] and summary["skipped"]["policy_version"] == 32
    third, last = groups[2][0], groups[-1][0]
    part, summary = _export(env, tmp_path, "--format", "nemo-gym", "--from", third, "--to", last)
    assert summary["groups"] == len(groups) - 2 and len(part) == 4 * (len(groups) - 2)

    # sft: the best sample of each group, as conversational messages
    sft, _ = _export(env, tmp_path, "--format", "sft")
    assert len(sft) == len(groups)
    best = {g.prompt_id: max(s.score.reward for s in g.samples) for _, g in groups}
    assert all(r["reward"] == best[r["prompt_id"]] for r in sft)
    msgs = sft[0]["messages"]
    assert msgs[0]["role"] == "user" and msgs[-1]["role"] == "assistant"
    call = next(m for m in msgs if m.get("tool_calls"))["tool_calls"][0]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"])
    assert any(m["role"] == "tool" and m["tool_call_id"] == call["id"] for m in msgs)

    # dpo: best vs worst where they differ
    dpo, summary = _export(env, tmp_path, "--format", "dpo")
    mixed = sum(1 for _, g in groups if len({s.score.reward for s in g.samples}) > 1)
    assert len(dpo) == mixed > 0 and summary["skipped"].get("no_margin", 0) == len(groups) - mixed
    for row in dpo:
        assert row["margin"] == row["score_chosen"] - row["score_rejected"] > 0
        assert row["prompt"][-1]["role"] == "user" and row["chosen"][0]["role"] == "assistant"

    _check_with_datasets_and_trl(tmp_path, sft, dpo)


def _check_with_datasets_and_trl(tmp_path, sft_rows, dpo_rows) -> None:
    from datasets import load_dataset
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
    from trl.data_utils import is_conversational

    from streamrl.models.tiny import build_model, build_tokenizer

    sft_file, dpo_file = tmp_path / "sft.jsonl", tmp_path / "dpo.jsonl"
    sft_file.write_text("".join(json.dumps(r) + "\n" for r in sft_rows))
    dpo_file.write_text("".join(json.dumps(r) + "\n" for r in dpo_rows))
    sft = load_dataset("json", data_files=str(sft_file), split="train")
    dpo = load_dataset("json", data_files=str(dpo_file), split="train")
    assert len(sft) == len(sft_rows) and len(dpo) == len(dpo_rows)
    assert is_conversational(sft[0]) and is_conversational(dpo[0])
    assert set(dpo.column_names) >= {"prompt", "chosen", "rejected"}

    tok = build_tokenizer()
    common = {"max_steps": 1, "per_device_train_batch_size": 2, "report_to": [],
              "save_strategy": "no", "use_cpu": True}  # fmt: skip
    trainer = SFTTrainer(
        model=build_model(),
        args=SFTConfig(output_dir=str(tmp_path / "sft-out"), **common),
        train_dataset=sft,
        processing_class=tok,
    )
    assert trainer.train().global_step == 1
    trainer = DPOTrainer(
        model=build_model(),
        ref_model=build_model(),  # built in memory: there is no name to load a copy from
        args=DPOConfig(output_dir=str(tmp_path / "dpo-out"), **common),
        train_dataset=dpo,
        processing_class=tok,
    )
    assert trainer.train().global_step == 1


def _sample(turns: list[schema.ModelTurn], items: list) -> schema.Sample:
    prompt = [schema.Message(role="user", content="add 2")]
    traj = schema.Trajectory(
        task_id="p:0", prompt_id="p", k=0, group_size=1, env="counter", items=prompt + items,
        n_input=1, turns=turns, status="completed",
    )  # fmt: skip
    score = schema.Score(task_id="p:0", prompt_id="p", k=0, reward=1.0)
    return schema.Sample(score=score, trajectory=traj)


def test_nemo_gym_rows_carry_each_turns_tokens_complete_or_not_at_all():
    """Each model turn's token ids and log-probs on its last output item, as NeMo Gym's token
    capture projects them; a turn that lacks any of them leaves the whole row without."""
    from streamrl.ops.export import _Indices, _nemo_gym_row

    call = schema.FunctionCall(call_id="c1", name="add", arguments='{"n": 2}')
    out = schema.FunctionCallOutput(call_id="c1", output="2")
    think = schema.Reasoning(content="add it")
    answer = schema.Message(role="assistant", content="2")
    turns = [
        schema.ModelTurn(index=0, items=[think, call], prompt_token_ids=[1, 2],
                         token_ids=[3, 4], logprobs=[-0.1, -0.2]),
        schema.ModelTurn(index=1, items=[answer], prompt_token_ids=[1, 2, 3, 4, 5],
                         token_ids=[6], logprobs=[-0.3]),
    ]  # fmt: skip
    row = _nemo_gym_row(_sample(turns, [think, call, out, answer]), _Indices(), "streamrl")
    output = row["response"]["output"]
    assert [o["type"] for o in output] == ["reasoning", "function_call", "function_call_output",
                                            "message"]  # fmt: skip
    tokens = [
        (o.get("prompt_token_ids"), o.get("generation_token_ids"), o.get("generation_log_probs"))
        for o in output
    ]
    assert tokens == [(None, None, None), ([1, 2], [3, 4], [-0.1, -0.2]), (None, None, None),
                      ([1, 2, 3, 4, 5], [6], [-0.3])]  # fmt: skip
    turns[1].logprobs = []  # one turn without log-probs: no token field anywhere
    row = _nemo_gym_row(_sample(turns, [think, call, out, answer]), _Indices(), "streamrl")
    assert not any("generation_token_ids" in o for o in row["response"]["output"])
