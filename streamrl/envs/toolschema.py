"""Checks a tool call's arguments against the JSON-schema subset that function tools use
(object/properties/required/type/enum/items/additionalProperties/minimum/maximum), with a
message a model can act on."""

from __future__ import annotations

from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def _check(schema: dict[str, Any], value: Any, path: str) -> str | None:
    expected = schema.get("type")
    if expected is not None:
        names = expected if isinstance(expected, list) else [expected]
        ok = False
        for name in names:
            types = _TYPES.get(name, (object,))
            # bool is an int in Python but not in JSON schema
            if isinstance(value, types) and not (isinstance(value, bool) and name != "boolean"):
                ok = True
        if not ok:
            return f"{path or 'arguments'} must be {' or '.join(names)}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path or 'value'} must be one of {schema['enum']}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            return f"{path} must be >= {schema['minimum']}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"{path} must be <= {schema['maximum']}"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                return f"missing required argument {name!r}"
        if schema.get("additionalProperties") is False:
            extra = sorted(set(value) - set(props))
            if extra:
                return f"unexpected argument(s) {', '.join(map(repr, extra))}"
        for name, sub in props.items():
            if name in value:
                problem = _check(sub, value[name], f"{path}.{name}" if path else name)
                if problem:
                    return problem
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            problem = _check(schema["items"], v, f"{path}[{i}]")
            if problem:
                return problem
    return None


def validate_arguments(schema: dict[str, Any], args: Any) -> str | None:
    """None when ``args`` fits ``schema``, else what is wrong."""
    if not schema:
        return None if isinstance(args, dict) else "arguments must be a JSON object"
    return _check({"type": "object", **schema}, args, "")
