"""Options several commands share, declared once so they are spelled and checked alike."""

from __future__ import annotations

import json
from typing import Any

import click


def _parse_env_options(ctx: click.Context, param: click.Parameter, pairs: tuple[str, ...]) -> dict:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value  # a plain string, e.g. a dataset path
    return out


def env_option(f: Any) -> Any:
    """``--env-option/-o KEY=VALUE``, repeatable, as a dict. The environment checks the keys
    and values against the options it declares."""
    return click.option(
        "--env-option",
        "-o",
        "env_options",
        multiple=True,
        metavar="KEY=VALUE",
        callback=_parse_env_options,
        help="Environment option (value parsed as JSON when it parses).",
    )(f)
