"""Checks a tool call's arguments against the tool's JSON Schema and turns the first problem
into one line a model can act on.

Two libraries, one job each: ``jsonschema-rs`` (compiled, ~0.2 µs) answers "valid?" on every
call, since most calls are; ``jsonschema`` (pure Python, ~7 µs) reports every problem with its
schema path, from which the one a depth-first walk meets first is told to the model.

Only the keywords function tools use are enforced: type, enum, minimum, maximum, required,
properties, items and ``additionalProperties: false``; others are ignored. Types are JSON's
(draft 4): a bool is neither an integer nor a number, 1.0 is a number but not an integer, and
``true`` is not one of ``[1, 2]``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jsonschema_rs

if TYPE_CHECKING:
    from jsonschema.exceptions import ValidationError

# the order in which one value's own problems are reported (before its properties' or items')
_OWN = ("type", "enum", "minimum", "maximum", "required", "additionalProperties")
_KEYWORDS = ("type", "enum", "minimum", "maximum", "required", "properties", "items")
_JSON_TYPES = frozenset({"array", "boolean", "integer", "null", "number", "object", "string"})


def _known_types(schema: dict) -> bool:
    """A ``type`` naming something JSON Schema does not have leaves that value unchecked (only
    that value: its siblings are still checked)."""
    names = schema.get("type")
    names = names if isinstance(names, list) else [names]
    return all(n in _JSON_TYPES for n in names if n is not None)


@functools.cache
def _reporting_class() -> Any:
    """The jsonschema validator class, built on the first wrong call: a worker whose calls are
    all valid never imports jsonschema (~5 MB)."""
    from jsonschema import Draft4Validator, Draft202012Validator, validators

    def no_extras(validator: Any, allowed: Any, instance: Any, schema: dict) -> Iterator[Any]:
        """``additionalProperties: false`` only; a schema there is not enforced."""
        if allowed is False:
            yield from Draft202012Validator.VALIDATORS["additionalProperties"](
                validator, allowed, instance, schema
            )

    def known_type(validator: Any, types: Any, instance: Any, schema: dict) -> Iterator[Any]:
        if _known_types(schema):
            yield from Draft202012Validator.VALIDATORS["type"](validator, types, instance, schema)

    return validators.create(
        meta_schema=Draft202012Validator.META_SCHEMA,
        validators={
            **{k: Draft202012Validator.VALIDATORS[k] for k in _KEYWORDS},
            "type": known_type,
            "additionalProperties": no_extras,
        },
        type_checker=Draft4Validator.TYPE_CHECKER,
    )


# validators by schema: a tool's schema is checked at every call, and building the validators
# costs more than the check; the schema is held so that its id() is not reused
_BUILT: dict[int, tuple[dict, dict, Any]] = {}


def _compiled(schema: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """(the object schema, its jsonschema-rs validator or None when that cannot compile it)."""
    hit = _BUILT.get(id(schema))
    if hit is None or hit[0] is not schema:
        if len(_BUILT) >= 256:
            _BUILT.pop(next(iter(_BUILT)))
        full = {"type": "object", **schema}
        try:
            fast = jsonschema_rs.Draft4Validator(_enforced(full))
        except Exception:  # e.g. a type JSON Schema does not have: the slow path decides
            fast = None
        hit = _BUILT[id(schema)] = (schema, full, fast)
    return hit[1], hit[2]


def _validators(schema: dict[str, Any]) -> tuple[Any, Any]:
    """(jsonschema validator, jsonschema-rs validator or None)."""
    full, fast = _compiled(schema)
    return _reporting_class()(full), fast


def _enforced(schema: Any) -> Any:
    """The schema cut to the keywords enforced here, so both libraries judge alike."""
    if not isinstance(schema, dict):
        return schema
    if not isinstance(schema.get("properties", {}), dict) or not isinstance(
        schema.get("items", {}), dict
    ):
        raise ValueError("only the slow path reads this schema")  # e.g. tuple-form items
    out = {k: schema[k] for k in ("type", "enum", "minimum", "maximum", "required") if k in schema}
    if not _known_types(schema):
        del out["type"]
    if out.get("required") == []:  # draft 4 wants one name at least; none asks for nothing
        del out["required"]
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: _enforced(v) for k, v in schema["properties"].items()}
    if isinstance(schema.get("items"), dict):
        out["items"] = _enforced(schema["items"])
    if schema.get("additionalProperties") is False:
        out["additionalProperties"] = False
    return out


def _walk_order(schema: dict, error: ValidationError) -> list[tuple[int, int]]:
    """The error's place in a depth-first walk that checks a value's own keywords (in ``_OWN``
    order), then its properties in the schema's order, then its items: the first problem that
    walk meets is the one reported, whatever order jsonschema found them in."""
    order = []
    node, steps, at = schema, list(error.relative_schema_path), iter(error.relative_path)
    for i, step in enumerate(steps[:-1]):
        if step == "properties":
            name = steps[i + 1]
            order.append((1, list(node["properties"]).index(name)))
            node = node["properties"][name]
            next(at)
        elif step == "items":
            order.append((1, next(at)))
            node = node["items"]
    order.append((0, _OWN.index(error.validator)))
    return order


def _where(error: ValidationError) -> str:
    path = ""
    for step in error.absolute_path:
        path += f"[{step}]" if isinstance(step, int) else f".{step}" if path else step
    return path


def _message(error: ValidationError) -> str:
    path, value, expected = _where(error), error.instance, error.validator_value
    if error.validator == "type":
        names = expected if isinstance(expected, list) else [expected]
        return f"{path or 'arguments'} must be {' or '.join(names)}, got {type(value).__name__}"
    if error.validator == "enum":
        return f"{path or 'value'} must be one of {expected}"
    if error.validator == "minimum":
        return f"{path} must be >= {expected}"
    if error.validator == "maximum":
        return f"{path} must be <= {expected}"
    if error.validator == "required":
        return f"missing required argument {next(n for n in expected if n not in value)!r}"
    extra = sorted(set(value) - set(error.schema.get("properties", {})))
    return f"unexpected argument(s) {', '.join(map(repr, extra))}"


def validate_arguments(schema: dict[str, Any], args: Any) -> str | None:
    """None when ``args`` fits ``schema``, else what is wrong."""
    if not schema:
        return None if isinstance(args, dict) else "arguments must be a JSON object"
    if (fast := _compiled(schema)[1]) is not None and fast.is_valid(args):
        return None
    validator, _ = _validators(schema)
    errors = list(validator.iter_errors(args))
    if not errors:
        return None
    return _message(min(errors, key=lambda e: _walk_order(validator.schema, e)))
