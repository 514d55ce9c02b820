"""Tool-argument checks: the one-line message a model gets for each kind of mistake, and the
compiled fast path (jsonschema-rs) agreeing with the reporting path (jsonschema)."""

from __future__ import annotations

import random

import pytest

from streamrl.envs.toolschema import _validators, validate_arguments

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "mode": {"enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "to": {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
        },
    },
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ({"n": 3}, None),
        ({"n": 3, "mode": "b", "tags": ["x"], "to": {"name": "y"}}, None),
        ([1], "arguments must be object, got list"),
        ({"n": "3"}, "n must be integer, got str"),
        ({"n": 1.0}, "n must be integer, got float"),
        ({"n": True}, "n must be integer, got bool"),
        ({"n": -1}, "n must be >= 0"),
        ({"n": 10}, "n must be <= 9"),
        ({"n": 1, "mode": "c"}, "mode must be one of ['a', 'b']"),
        ({}, "missing required argument 'n'"),
        ({"n": 1, "x": 0, "w": 1}, "unexpected argument(s) 'w', 'x'"),
        ({"n": 1, "tags": ["x", 2]}, "tags[1] must be string, got int"),
        ({"n": 1, "to": {}}, "missing required argument 'name'"),
        ({"n": 1, "to": {"name": 5}}, "to.name must be string, got int"),
        # the first problem of a depth-first walk: the value's own keywords, then properties
        # in the schema's order
        ({"n": "x", "y": 1}, "unexpected argument(s) 'y'"),
        ({"n": "x", "to": {}}, "n must be integer, got str"),
        ({"mode": "c"}, "missing required argument 'n'"),
    ],
)
def test_each_mistake_gets_one_line(args, problem):
    assert validate_arguments(SCHEMA, args) == problem


def test_a_type_json_schema_does_not_have_leaves_only_that_value_unchecked():
    schema = {"properties": {"n": {"type": "decimal"}, "m": {"type": "integer"}}}
    assert validate_arguments(schema, {"n": "x", "m": 1}) is None
    assert validate_arguments(schema, {"n": "x", "m": "y"}) == "m must be integer, got str"
    assert _validators(schema)[1] is not None  # the compiled path reads it too


def _schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["integer", "number", "string", "boolean", "array", "object", "decimal", None]
    kind = rng.choice(kinds)  # "decimal": a type JSON Schema does not have
    s: dict = {} if kind is None else {"type": kind}
    if kind in ("integer", "number") and rng.random() < 0.5:
        s["minimum" if rng.random() < 0.5 else "maximum"] = rng.choice([0, 1, 2.5])
    if rng.random() < 0.2:
        s["enum"] = rng.sample([0, 1, 1.0, True, False, "a", None, [1], {"k": 1}], 3)
    if kind == "array" and depth < 2:
        s["items"] = _schema(rng, depth + 1)
    if kind == "object" and depth < 2:
        names = rng.sample(["a", "b", "c"], rng.randint(0, 3))
        s["properties"] = {n: _schema(rng, depth + 1) for n in names}
        s["required"] = rng.sample(["a", "b", "c"], rng.randint(0, 2))
        if rng.random() < 0.5:
            s["additionalProperties"] = False
        if rng.random() < 0.2:
            s["pattern"] = "^z"  # not enforced here, by either path
    return s


def _value(rng: random.Random, depth: int = 0):
    choices = [0, 1, -1, 1.0, 2.5, True, False, None, "a", "z"]
    if depth < 2:
        choices += ["list", "dict"]
    v = rng.choice(choices)
    if v == "list":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if v == "dict":
        keys = rng.sample(["a", "b", "c", "d"], rng.randint(0, 4))
        return {k: _value(rng, depth + 1) for k in keys}
    return v


def test_the_fast_path_agrees_with_the_reporting_path():
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    compared = 0
    for _ in range(3000):
        schema = _schema(rng)
        slow, fast = _validators(schema)
        if fast is None:  # the compiled path refused the schema: the reporting path decides
            continue
        value = _value(rng)
        assert fast.is_valid(value) == (not list(slow.iter_errors(value))), (seed, schema, value)
        compared += 1
    assert compared > 2500, f"only {compared} of 3000 schemas compiled (seed {seed})"
