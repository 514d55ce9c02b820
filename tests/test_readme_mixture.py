"""The README's mixture section, run as written: its config is `examples/mixture.toml`, and
its commands (all but the workers) change a stored mixture the way the text says."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parent.parent
SECTION = (ROOT / "README.md").read_text().split("## Training on a mixture", 1)[1]
SECTION = SECTION.split("\n## ", 1)[0]


def test_the_config_shown_is_the_example_file():
    shown = re.search(r"```toml\n(.*?)```", SECTION, re.S).group(1)
    assert shown == (ROOT / "examples" / "mixture.toml").read_text()


def test_the_mixture_commands_run_as_written(redis_url, r, subprocess_env):
    r.delete(*r.keys("srl:{readme-mix}:*") or ["-"])
    env = {**subprocess_env, "STREAMRL_REDIS_URL": redis_url, "COLUMNS": "250"}
    block = re.search(r"```bash\n(.*?)```", SECTION, re.S).group(1)
    outs = []
    for line in block.splitlines():
        if line.startswith("export "):
            name, _, value = line.split(" ", 1)[1].partition("=")
            env[name] = value
            continue
        if " worker " in f" {line} ":
            continue  # the workers: tests/workers/test_mixture_pipeline.py runs real ones
        argv = shlex.split(line)
        assert argv[0] == "streamrl"
        out = run_cli(argv[1:], env)
        assert out.returncode == 0, (line, out.stderr)
        outs.append(out)
    assert "pushed 200 prompts (800 samples)" in outs[0].stdout
    drawn = dict(
        (name, int(n))
        for name, n in re.findall(r"(\S+) (\d+)", outs[0].stderr.split("drawn by environment:")[1])
    )
    assert sum(drawn.values()) == 200 and drawn["counter"] > drawn["copy"] > drawn["math-canaries"]
    info = json.loads(run_cli(["status", "--json"], env).stdout)
    rows = {row["name"]: row for row in info["mixture"]["envs"]}
    assert set(rows) == {"counter", "copy", "math-canaries", "nim"}
    assert rows["counter"]["removed"] and rows["copy"]["weight"] == 0.6
    assert rows["nim"]["share"] == 0.2 and rows["math-canaries"]["paused"] == ""
    assert info["mixture"]["version"] == 3  # nim added, copy re-weighted, counter removed
    assert "environments (mixture version 3)" in re.sub(r"\s+", " ", outs[-1].stdout)
    bad = run_cli(["mix", "--env", "nosuch", "--weight", "1"], env)  # one line, nothing lost
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        "Error: envs 'nosuch': unknown environment 'nosuch'; available: "
        + bad.stderr.split("available: ", 1)[1].strip()
    ]
    assert json.loads(run_cli(["status", "--json"], env).stdout)["mixture"]["version"] == 3
