"""Every built-in environment declares its options, so a typo or a bad value is refused where it
enters instead of being ignored."""

from __future__ import annotations

import pytest

from streamrl.envs import make_env
from streamrl.envs.base import OptionError
from streamrl.envs.registry import BUILTIN


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_defaults_load_and_unknown_options_are_refused(name):
    env = make_env(name)
    assert env.Options is not None
    assert set(env.options) == set(env.Options.__struct_fields__)  # defaults filled in
    with pytest.raises(OptionError, match=rf"environment '{name}' has no option 'bogus'; known"):
        make_env(name, bogus=1)


@pytest.mark.parametrize(
    ("name", "options", "says"),
    [
        ("copy", {"symbols": 0}, "symbols=0: Expected `int` >= 1"),
        ("counter", {"steps": "two"}, "steps='two': Expected `int`, got `str`"),
        ("countdown", {"count": 9}, "count=9: Expected `int` <= 6"),
        ("code", {"timeout_s": -1}, "timeout_s=-1: Expected `float` > 0"),
        ("nim", {"blunder_rate": 2}, "blunder_rate=2: Expected `float` <= 1"),
        ("sudoku", {"size": 5}, "size=5: Invalid enum value 5"),
    ],
)
def test_bad_values_name_the_option_and_what_is_allowed(name, options, says):
    with pytest.raises(OptionError, match=None) as e:
        make_env(name, **options)
    assert says in str(e.value)


def test_strings_from_the_command_line_convert_where_unambiguous():
    assert make_env("counter", steps="3").options["steps"] == 3
    assert make_env("nim", heaps=4).options == {
        "winning_fraction": 0.5,
        "blunder_rate": 0.0,
        "max_illegal": 3,
        "heaps": 4,
        "max_heap": 5,
    }
