"""Responses items <-> chat messages, and completion text -> items (``policy/_chat.py``)."""

from __future__ import annotations

import json

from streamrl.models.tiny import build_tokenizer
from streamrl.policy._chat import parse_completion, request_seed, to_messages
from streamrl.schema import FunctionCall, FunctionCallOutput, Message, Reasoning


def test_assistant_output_of_one_turn_is_one_message():
    items = [
        Message(role="system", content="be brief"),
        Message(role="user", content="add 1 and 2"),
        Reasoning(content="use the tool"),
        Message(role="assistant", content="calling"),
        FunctionCall(call_id="c1", name="add", arguments='{"a": 1, "b": 2}'),
        FunctionCall(call_id="c2", name="add", arguments="{bad"),
        FunctionCallOutput(call_id="c1", output="3"),
        FunctionCallOutput(call_id="c2", output="error: not JSON"),
        Message(role="assistant", content="3"),
    ]
    messages = to_messages(items, arguments_as_dict=True)
    assert [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
    ]
    turn = messages[2]
    assert turn["content"] == "calling" and turn["reasoning_content"] == "use the tool"
    assert [c["function"]["arguments"] for c in turn["tool_calls"]] == [{"a": 1, "b": 2}, "{bad"]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "3"}
    wire = to_messages(items)  # OpenAI wire format: arguments stay JSON text
    assert wire[2]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'
    json.dumps(wire)


def test_plain_text_keeps_special_tokens():
    assert parse_completion("<bos> a b", 0) == [Message(role="assistant", content="<bos> a b")]
    assert parse_completion("", 0) == [Message(role="assistant", content="")]


def test_tool_calls_reasoning_and_text():
    text = (
        '<think>need add</think>sure <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        '\n<tool_call>{"name": "mul", "arguments": "{\\"a\\": 2}"}</tool_call>'
    )
    assert parse_completion(text, 3) == [
        Reasoning(content="need add"),
        Message(role="assistant", content="sure"),
        FunctionCall(call_id="call_3_0", name="add", arguments='{"a": 1}'),
        FunctionCall(call_id="call_3_1", name="mul", arguments='{"a": 2}'),
    ]


def test_malformed_and_truncated_tool_calls_keep_the_raw_text():
    items = parse_completion('<tool_call>{"name": "add", "arguments": {a: 1}}</tool_call>', 0)
    assert items == [
        FunctionCall(
            call_id="call_0_0", name="add", arguments='{"name": "add", "arguments": {a: 1}}'
        )
    ]
    (cut,) = parse_completion('<tool_call>{"name": "add", "argu', 1)  # hit max_new_tokens
    assert cut == FunctionCall(call_id="call_1_0", name="add", arguments='{"name": "add", "argu')
    (nameless,) = parse_completion("<tool_call>oops</tool_call>", 0)
    assert nameless == FunctionCall(call_id="call_0_0", name="", arguments="oops")


def test_request_seed_depends_on_task_and_turn():
    assert request_seed(0, "p:1", 0) == request_seed(0, "p:1", 0)
    assert (
        len(
            {
                request_seed(0, "p:1", 0),
                request_seed(0, "p:1", 1),
                request_seed(0, "p:2", 0),
                request_seed(1, "p:1", 0),
            }
        )
        == 4
    )


def test_tiny_template_renders_converted_messages():
    tok = build_tokenizer()
    messages = to_messages([Message(role="user", content="copy : a")], arguments_as_dict=True)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<bos> <user> copy : a <assistant>"


def test_a_template_without_tools_gets_calls_inline_and_the_tools_in_words():
    """SmolLM2's plain ChatML drops ``tool_calls``: an earlier call (a few-shot example) must
    then be written into the assistant's text, in the form ``parse_completion`` reads back,
    and the tools described in the system message."""
    from streamrl.policy._chat import tool_prompt, with_system
    from streamrl.schema import FunctionTool

    call = FunctionCall(call_id="c1", name="lookup", arguments='{"name": "Ana"}')
    items = [Message(role="user", content="code of Ana?"), call,
             FunctionCallOutput(call_id="c1", output="1234")]  # fmt: skip
    messages = to_messages(items, arguments_as_dict=True, inline_tool_calls=True)
    text = messages[1]["content"]
    assert "tool_calls" not in messages[1]
    assert text == '<tool_call>{"name": "lookup", "arguments": {"name": "Ana"}}</tool_call>'
    (back,) = parse_completion(text, 0)
    assert (back.name, json.loads(back.arguments)) == ("lookup", {"name": "Ana"})

    tools = [FunctionTool(name="lookup", description="Find a code.",
                          parameters={"type": "object", "properties": {"name": {}}})]  # fmt: skip
    prompt = tool_prompt(tools)
    assert "- lookup(name): Find a code." in prompt and "<tool_call>" in prompt
    with_sys = with_system(messages, prompt)
    assert with_sys[0] == {"role": "system", "content": prompt} and with_sys[1:] == messages
    merged = with_system([{"role": "system", "content": "Be brief."}], prompt)
    assert merged == [{"role": "system", "content": f"{prompt}\nBe brief."}]
