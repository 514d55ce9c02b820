"""Bad input on the command line gets one line that says what is wrong, a non-zero exit, no
traceback, and no password; ``--debug`` brings the traceback back. Each case is the real
``streamrl`` command in its own process."""

from __future__ import annotations

import pytest

from streamrl.local.embedded import free_port
from tests.support.cli import run_cli

SECRET = "s3cret-pw"

# (id, argv, extra environment, exit status, text the last line must contain)
CASES = [
    ("url-scheme", ["--redis", "foo://x", "status"], {}, 1, "'foo://x' is not a Redis URL"),
    (
        "url-no-scheme-from-env",
        ["status"],
        {"STREAMRL_REDIS_URL": "127.0.0.1:6380"},
        1,
        "did you mean redis://127.0.0.1:6380",
    ),
    (
        "unreachable-with-password",
        ["--redis", "redis://:{secret}@127.0.0.1:{closed}/0", "status"],
        {},
        1,
        "cannot reach Redis at redis://:***@127.0.0.1:",
    ),
    (
        "learn-url-scheme",
        ["--redis", "foo://x", "learn", "--config", "configs/copy-tiny.toml"],
        {},
        2,
        "is not a Redis URL",
    ),
    (
        "env-module-missing",
        ["--redis", "{url}", "produce", "--env", "no_such_module:Env", "--count", "1"],
        {},
        1,
        "cannot import no_such_module: No module named 'no_such_module'",
    ),
    ("env-attribute-missing", ["--redis", "{url}", "produce", "--env", "streamrl.schema:Nope",
     "--count", "1"], {}, 1, "module streamrl.schema has no 'Nope'"),
    ("env-not-an-environment", ["--redis", "{url}", "produce", "--env", "streamrl.schema:Task",
     "--count", "1"], {}, 1, "is not an Environment subclass"),
    ("env-constructor-raises", ["--redis", "{url}", "produce", "--env",
     "tests.support.envs:BrokenInitEnv", "--count", "1"], {}, 1,
     "RuntimeError: this environment cannot start"),
    ("env-option-unknown", ["--redis", "{url}", "produce", "--env", "counter", "--count", "1",
     "-o", "stpes=3"], {}, 1,
     "environment 'counter' has no option 'stpes'; known: steps, raise_on"),
    ("env-option-type", ["--redis", "{url}", "produce", "--env", "counter", "--count", "1",
     "--env-option", "steps=abc"], {}, 1, "option steps='abc': Expected `int`, got `str`"),
    ("env-option-range", ["--redis", "{url}", "produce", "--env", "counter", "--count", "1",
     "--env-option", "steps=-1"], {}, 1, "option steps=-1: Expected `int` >= 0"),
    ("env-option-choice", ["--redis", "{url}", "produce", "--env", "sudoku", "--count", "1",
     "--env-option", "size=5"], {}, 1, "option size=5: Invalid enum value 5"),
    ("env-option-no-equals", ["--redis", "{url}", "produce", "--env", "counter", "--count", "1",
     "--env-option", "steps"], {}, 2, "expected KEY=VALUE, got 'steps'"),
    ("audit-env-option-unknown", ["audit", "--env", "counter", "--env-option", "foo=1"], {}, 2,
     "environment 'counter' has no option 'foo'"),
    ("reverify-env-option-no-equals", ["--redis", "{url}", "reverify", "-o", "x"], {}, 2,
     "expected KEY=VALUE"),
    ("policy-unknown-backend", ["--redis", "{url}", "produce", "--env", "copy", "--count", "1",
     "--policy", "gpt5"], {}, 1, "policy.backend"),
    ("policy-hf-without-model", ["--redis", "{url}", "produce", "--env", "copy", "--count", "1",
     "--policy", "hf"], {}, 1, "policy.model is empty"),
    ("policy-hf-missing-dir", ["--redis", "{url}", "produce", "--config", "{hf_nowhere}",
     "--count", "1"], {}, 1, "policy.model = 'no/such/model': no such directory"),
    ("policy-openai-without-url", ["--redis", "{url}", "produce", "--env", "copy", "--count",
     "1", "--policy", "openai"], {}, 1, "the openai backend needs the server's http(s) URL"),
    ("learn-missing-model", ["--redis", "{url}", "learn", "--config", "{hf_nowhere}"], {}, 1,
     "learner.model = 'no/such/model': no such directory"),
    ("learn-model-not-a-model", ["--redis", "{url}", "learn", "--config", "{not_a_model}"], {},
     1, "is a directory without config.json"),
    ("learn-unreachable-with-password", ["--redis", "redis://:{secret}@127.0.0.1:{closed}/0",
     "learn", "--config", "{fake_model}"], {}, 1,
     "cannot reach Redis at redis://:***@127.0.0.1:"),
    ("dead-limit-negative", ["--redis", "{url}", "dead", "--limit", "-1"], {}, 2, "'--limit'"),
    ("watch-interval-negative", ["--redis", "{url}", "watch", "--interval", "-1"], {}, 2,
     "'--interval'"),
    ("bench-tasks-zero", ["bench", "pipeline", "--tasks", "0"], {}, 2, "'--tasks'"),
    ("chaos-kills-negative", ["bench", "chaos", "--kills", "-1"], {}, 2, "'--kills'"),
    ("produce-count-negative", ["--redis", "{url}", "produce", "--env", "copy", "--count", "-1"],
     {}, 2, "'--count'"),
    ("produce-group-size-zero", ["--redis", "{url}", "produce", "--env", "copy", "--count", "1",
     "--group-size", "0"], {}, 2, "'--group-size'"),
    ("replay-from-garbage", ["--redis", "{url}", "replay", "verify", "--from", "garbage"], {}, 2,
     "'garbage' is not a stream entry ID"),
    ("reverify-from-garbage", ["--redis", "{url}", "reverify", "--from", "garbage"], {}, 2,
     "'garbage' is not a stream entry ID"),
    ("audit-samples-negative", ["audit", "--env", "copy", "--samples", "-1"], {}, 2,
     "'--samples'"),
    ("sandbox-memory-zero", ["sandbox", "run", "{program}", "--memory-mb", "0"], {}, 2,
     "'--memory-mb'"),
    ("sandbox-memory-negative", ["sandbox", "run", "{program}", "--memory-mb", "-5"], {}, 2,
     "'--memory-mb'"),
    ("sandbox-timeout-negative", ["sandbox", "run", "{program}", "--timeout", "-1"], {}, 2,
     "'--timeout'"),
]  # fmt: skip


def _configs(tmp_path) -> dict[str, str]:
    """Run configs whose models are missing, not models, or stand-ins that pass the check."""
    out = {}
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "fake-model").mkdir()
    (tmp_path / "fake-model" / "config.json").write_text("{}")
    models = {
        "hf_nowhere": "no/such/model",
        "not_a_model": str(tmp_path / "empty-dir"),
        "fake_model": str(tmp_path / "fake-model"),
    }
    for name, model in models.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(
            f'run = "{name}"\nenv = "copy"\n[policy]\nbackend = "hf"\nmodel = "{model}"\n'
            f'[learner]\nmodel = "{model}"\n'
        )
        out[name] = str(path)
    return out


@pytest.mark.parametrize(
    ("argv", "env", "status", "says"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_command_line_gets_one_clear_line(
    argv, env, status, says, redis_url, subprocess_env, tmp_path
):
    program = tmp_path / "hello.py"
    program.write_text("print('hello')\n")
    fill = {"url": redis_url, "secret": SECRET, "closed": free_port(), "program": program}
    fill.update(_configs(tmp_path))
    argv = [a.format(**fill) for a in argv]
    subprocess_env = {k: v for k, v in subprocess_env.items() if k != "STREAMRL_REDIS_URL"}
    done = run_cli(["--run-dir", str(tmp_path / "rd"), *argv], {**subprocess_env, **env})
    out = done.stdout + done.stderr
    assert done.returncode == status, out
    assert "Traceback" not in out, out
    assert SECRET not in out
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: ") and says in last, out


def test_debug_shows_the_traceback(redis_url, subprocess_env):
    env = "tests.support.envs:BrokenInitEnv"
    argv = ["--debug", "--redis", redis_url, "produce", "--env", env]
    done = run_cli([*argv, "--count", "1"], subprocess_env)
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "RuntimeError: this environment" in done.stderr


def test_stream_ids_that_replay_takes(redis_url, subprocess_env, tmp_path):
    base = ["--run-dir", str(tmp_path / "rd"), "--redis", redis_url, "--run", "ids"]
    made = run_cli([*base, "produce", "--env", "copy", "--count", "1"], subprocess_env)
    assert made.returncode == 0, made.stderr
    for stage, offset in (("verify", "0"), ("rollout", "$"), ("learner", "1-0"), ("verify", "5")):
        done = run_cli([*base, "replay", stage, "--from", offset], subprocess_env)
        assert done.returncode == 0, done.stderr
        assert f"after {offset}" in done.stdout


# a command added to the real group that prints more than a pipe holds, so that the write
# fails while the command runs (a small output would fail only in the exit's flush)
_LONG_OUTPUT = """
import click
from streamrl.cli import main

@main.command("long-output")
def long_output():
    click.echo("x" * 4_000_000)

main()
"""


def test_a_reader_that_went_away_ends_the_command_quietly(subprocess_env):
    """`streamrl demo --json | tail -1` stopped by a signal to the whole pipeline: the reader
    dies first and the summary cannot be written. No `Error:` line, no traceback from the
    exit's flush; the status a shell reports for `yes | head`."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _LONG_OUTPUT, "long-output"],
            stdout=write, stderr=subprocess.PIPE, text=True, env=subprocess_env, timeout=60,
        )  # fmt: skip
    finally:
        os.close(write)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == ""
