"""A mixture's figures per environment: the real learner on the tiny model reads groups of two
environments and its step log, progress hash, `streamrl status` and the Prometheus metrics
each show reward, solved / no-signal rates, samples per second, dead letters and staleness
per environment."""

from __future__ import annotations

import msgspec
import pytest
import structlog
from groupdata import feed, make_groups, run_learner_thread
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.streams import ensure_groups
from streamrl.config import EnvEntry, Mixture
from streamrl.learner.config import LearnerConfig
from streamrl.ops.metrics import _Collector
from streamrl.ops.status import collect
from streamrl.ops.views import status_table
from streamrl.producer import mixture

RUN = "byenv"


def _relabel(group: schema.Group, env: str) -> schema.Group:
    samples = [
        msgspec.structs.replace(s, trajectory=msgspec.structs.replace(s.trajectory, env=env))
        for s in group.samples
    ]
    return msgspec.structs.replace(group, samples=samples)


def test_learner_status_and_metrics_show_each_environment(redis_url, r, tiny_dir, tmp_path):
    keys = Keys(RUN)
    ensure_groups(r, keys)
    groups = make_groups(tiny_dir, 8, seed=5)
    hard = [_relabel(g, "copy-hard") for g in groups[4:]]
    feed(r, keys, [*groups[:4], *hard])
    mixture.ensure(
        r,
        RUN,
        Mixture(envs=[EnvEntry(env="copy"), EnvEntry(name="copy-hard", env="copy", weight=3)]),
    )
    dead = schema.DeadLetter(stage="verify", entry_id="1-0", reason="verifier x raised E",
                             payload=schema.encode(hard[0].samples[0].trajectory))  # fmt: skip
    r.xadd(keys.dead, {"id": "1-0", "p": schema.encode(dead)})
    cfg = LearnerConfig(
        model=str(tiny_dir), output_dir=str(tmp_path / "out"), torch_threads=1, batch_groups=2,
        checkpoint_every=100, sync_every=100, lr=1e-3, block_ms=100, logging_steps=1,
    )  # fmt: skip
    with structlog.testing.capture_logs() as logs:
        run_learner_thread(redis_url, RUN, cfg, exit_when_idle=0.5)

    per_env = msgspec.json.decode(r.hget(keys.learner, "per_env"))
    assert set(per_env) == {"copy", "copy-hard"}
    for name, gs in (("copy", groups[:4]), ("copy-hard", hard)):
        f = per_env[name]
        assert f["groups"] == 4 and f["samples"] == 16
        assert f["reward_mean"] == pytest.approx(sum(g.reward_mean for g in gs) / 4, abs=1e-3)
        assert f["staleness_mean"] == 0.0 and f["samples_per_s"] >= 0
    steps = [e for e in logs if e["event"] == "step"]
    assert steps and set(steps[-1]["per_env"]) == {"copy", "copy-hard"}

    info = collect(r, RUN)
    rows = {row["name"]: row for row in info["mixture"]["envs"]}
    assert rows["copy-hard"]["dead_letters"] == 1 and rows["copy"]["dead_letters"] == 0
    assert rows["copy-hard"]["share"] == 0.75 and rows["copy-hard"]["groups"] == 4
    from rich.console import Console

    console = Console(record=True, width=250)
    console.print(status_table(info))
    text = console.export_text()
    assert "environments (mixture version 0)" in text and "copy-hard" in text

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(r, lambda: [RUN]))
    scraped = {
        (s.name, s.labels.get("env")): s.value
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
    }
    want = per_env["copy-hard"]["reward_mean"]
    assert scraped[("streamrl_env_reward_mean", "copy-hard")] == pytest.approx(want)
    assert scraped[("streamrl_env_weight", "copy-hard")] == 3.0
    assert scraped[("streamrl_env_paused", "copy")] == 0.0
    assert scraped[("streamrl_env_dead_letters_total", "copy-hard")] == 1.0
    for family in ("solved_rate", "no_signal_rate", "samples_per_second", "staleness_mean"):
        assert ("streamrl_env_" + family, "copy") in scraped


def test_a_mixture_name_is_solved_at_its_environments_top(tiny_dir):
    """``copy-hard`` is no registered environment: the stored mixture says it is ``copy``,
    whose max_reward is the top; unknown, the top falls back to the best reward seen."""
    from streamrl.learner.outcomes import Outcomes

    group = _relabel(make_groups(tiny_dir, 1, seed=5)[0], "copy-hard")
    assert Outcomes(10, None, lambda: {"copy-hard": "copy"}).top(group) == 1.0
    assert Outcomes(10, None).top(group) is None  # nothing seen yet
