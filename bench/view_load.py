"""How fast `streamrl view` answers on a long run: page load times with 100,000 scored samples.

    python bench/view_load.py [--samples 100000] [--group-size 4] [--repeats 5]

Writes ``--samples`` scored samples straight into a private redis-server, as the pipeline
leaves them: ``samples / group-size`` complete groups on the ``groups`` stream (counter-style
episodes of three model turns, a tool call and its output per turn, 24 token ids and
log-probs per turn, Scores with components and details, policy versions rising from 0 to
99 over the run) and one Score per sample on the ``scored`` stream. Then starts
``streamrl view`` on it and times, from a client on the same machine, the whole response of:

- ``live_first``: the live page, first load (it reads the newest 5,000 scored entries);
- ``live``, ``api_live``: the live page and its JSON again (median of ``--repeats``);
- ``samples``: the trajectory list, newest first (50 samples);
- ``search_miss``: a search for a prompt only in the oldest group: one request looks at its
  bound of 2,000 groups and offers the next page;
- ``sample``, ``group``: one episode, one group side by side.

``--browser`` also times, in Debian's chromium driven by Playwright, navigation to the
``load`` event of the live page, the trajectory list and one episode (``browser_ms``: the
page's scripts, its stylesheet and the chart library included).

Prints one JSON object: the times in milliseconds, the stream lengths and Redis
``used_memory``. Nothing here pages by anything but entry IDs: the times should not grow
with the length of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import redis

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.local.embedded import EmbeddedRedis, free_port
from streamrl.schema import FunctionCall, FunctionCallOutput, Message, ModelTurn

ROOT = Path(__file__).resolve().parent.parent
RUN = "load"


def _turn(i: int, item, version: int, rng: random.Random) -> ModelTurn:
    return ModelTurn(
        index=i,
        items=[item],
        prompt_token_ids=[rng.randrange(49152) for _ in range(24)],
        token_ids=[rng.randrange(49152) for _ in range(24)],
        logprobs=[-rng.random() * 3 for _ in range(24)],
        policy_version=version,
        worker="srl-rollout-0",
        seconds=0.05,
    )


def sample(prompt: int, k: int, size: int, version: int, rng: random.Random) -> schema.Sample:
    """One counter-style episode: two tool calls, then the answer; right or off by a few."""
    start, numbers = rng.randint(0, 99), [rng.randint(1, 20), rng.randint(1, 20)]
    pid, tid = f"counter-s0-{prompt:07d}", f"counter-s0-{prompt:07d}:{k}"
    text = (
        f"The counter starts at {start}. Use the add tool to add each of these numbers in "
        f"order: {numbers[0]} {numbers[1]}. Then reply with the final value only."
    )
    items: list = [Message(role="user", content=text)]
    turns, value = [], start
    for i, n in enumerate(numbers):
        call = FunctionCall(call_id=f"call_{i}", name="add", arguments=json.dumps({"n": n}))
        value += n
        items += [call, FunctionCallOutput(call_id=f"call_{i}", output=str(value))]
        turns.append(_turn(i, call, version, rng))
    right = rng.random() < min(0.95, 0.2 + version / 120)
    answer = Message(role="assistant", content=str(value if right else value + rng.randint(1, 5)))
    items.append(answer)
    turns.append(_turn(2, answer, version, rng))
    now = time.time()
    traj = schema.Trajectory(
        task_id=tid, prompt_id=pid, k=k, group_size=size, env="counter", items=items,
        n_input=1, turns=turns, status="completed", data={"start": start, "numbers": numbers},
        started_at=now - 0.2, finished_at=now, worker="srl-rollout-0",
    )  # fmt: skip
    score = schema.Score(
        task_id=tid, prompt_id=pid, k=k, reward=1.0 if right else 0.0,
        components={"answer": float(right), "tool_use": 1.0},
        details={"expected": str(value), "answer": answer.content},
        verifier="counter", verifier_version="1", rollout_id=f"{now:.0f}-0",
        policy_versions=[version], worker="srl-verify-0", scored_at=now, env="counter",
    )  # fmt: skip
    return schema.Sample(score=score, trajectory=traj)


def fill(r: redis.Redis, samples: int, size: int) -> None:
    keys, rng = Keys(RUN), random.Random(0)
    groups = samples // size
    pipe = r.pipeline(transaction=False)
    for g in range(groups):
        version = g * 100 // groups
        members = [sample(g, k, size, version, rng) for k in range(size)]
        rewards = [m.score.reward or 0.0 for m in members]
        mean = sum(rewards) / size
        std = (sum((x - mean) ** 2 for x in rewards) / size) ** 0.5
        group = schema.Group(schema.SCHEMA_VERSION, members[0].score.prompt_id, size, mean, std,
                             members)  # fmt: skip
        for m in members:
            pipe.xadd(keys.scored, {"p": schema.encode(m.score)})
        pipe.xadd(keys.groups, {"p": schema.encode(group)})
        if g % 250 == 249:
            pipe.execute()
    pipe.hset(keys.stats, mapping={"groups_completed": groups, "trajectories": groups * size})
    pipe.execute()


def _get(url: str) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as res:
        res.read()
        assert res.status == 200, res.status
    return (time.perf_counter() - t0) * 1000


def _browser_times(base: str, paths: dict[str, str], repeats: int) -> dict[str, float]:
    """Navigation to the load event in chromium, median of ``repeats`` per page."""
    from playwright.sync_api import sync_playwright

    out = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium",
                                     args=["--no-sandbox", "--disable-gpu"])  # fmt: skip
        page = browser.new_page()
        for name, path in paths.items():
            runs = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                page.goto(base + path, wait_until="load")
                runs.append((time.perf_counter() - t0) * 1000)
            out[name] = round(statistics.median(runs), 1)
        browser.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--browser", action="store_true", help="also time page loads in chromium")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="view-load-") as tmp, EmbeddedRedis(tmp) as server:
        r = redis.Redis.from_url(server.url)
        t0 = time.perf_counter()
        fill(r, args.samples, args.group_size)
        fill_s = time.perf_counter() - t0
        keys = Keys(RUN)
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        argv = ["--redis", server.url, "--run", RUN, "view", "--port", str(port)]
        proc = subprocess.Popen([sys.executable, "-m", "streamrl.cli", *argv], env=env,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(base + "/static/view.css", timeout=5).read()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            newest = r.xrevrange(keys.groups, count=1)[0][0].decode()
            oldest = schema.GROUP.decode(r.xrange(keys.groups, count=1)[0][1][b"p"]).prompt_id
            miss = "/samples?" + urllib.parse.urlencode({"prompt": oldest})
            times = {"live_first": round(_get(base + "/"), 1)}
            paths = {
                "live": "/", "api_live": "/api/live", "samples": "/samples",
                "search_miss": miss, "sample": f"/sample/0/{newest}/0",
                "group": f"/group/0/{newest}",
            }  # fmt: skip
            for name, path in paths.items():
                runs = [_get(base + path) for _ in range(args.repeats)]
                times[name] = round(statistics.median(runs), 1)
            shown = {n: paths[n] for n in ("live", "samples", "sample")}
            browser = _browser_times(base, shown, args.repeats) if args.browser else None
        finally:
            proc.terminate()
            proc.wait(timeout=20)
        print(json.dumps({
            "samples": r.xlen(keys.scored), "groups": r.xlen(keys.groups),
            "redis_used_memory_mb": round(r.info("memory")["used_memory"] / 2**20, 1),
            "fill_s": round(fill_s, 1), "median_ms_of": args.repeats, "ms": times,
            **({"browser_ms": browser} if browser else {}),
        }))  # fmt: skip


if __name__ == "__main__":
    main()
