"""deploy/ is checked: every Kubernetes manifest against the Kubernetes schemas
(kubernetes-validate, strict) and KEDA's ScaledObject CRD schema (vendored, validated with
jsonschema), the compose file against the Compose Specification (check-jsonschema), and every
command, flag and environment variable the deploy files use against the real CLIs, so that a
renamed flag breaks a test instead of a cluster."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import click
import jsonschema
import kubernetes_validate
import pytest
import yaml

from streamrl import defaults as d
from streamrl.bus.keys import Keys
from tests.support.cli import ROOT

DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes these manifests promise to work on
KEDA_CRD = Path(__file__).parent / "deploy_schemas" / "keda.sh_scaledobjects.yaml"
STREAMRL_IMAGES = re.compile(r"^streamrl:(\w+)$")


@pytest.fixture(autouse=True)
def _in_the_image_workdir(monkeypatch):
    """Relative paths in deploy/ (configs/copy-tiny.toml) resolve as in the image's /app."""
    monkeypatch.chdir(ROOT)


def k8s_docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


# ------------------------------------------------------------------------- schemas
def _strict(schema: dict) -> dict:
    """The CRD's OpenAPI schema with unknown fields refused, as the API server's pruning would
    silently drop them (what kubeconform's openapi2jsonschema --strict does)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node.setdefault("additionalProperties", False)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    return schema


@cache
def keda_validator() -> jsonschema.protocols.Validator:
    crd = yaml.safe_load(KEDA_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


def validate_manifest(doc: dict) -> None:
    """Raise with the first problem of one manifest; no kind goes unchecked."""
    if doc["apiVersion"] == "keda.sh/v1alpha1" and doc["kind"] == "ScaledObject":
        keda_validator().validate(doc)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    ("name", "doc"), k8s_docs(), ids=lambda x: x if isinstance(x, str) else x["kind"]
)
def test_manifest_passes_its_schema(name, doc):
    validate_manifest(doc)


def test_the_validators_refuse_broken_manifests():
    """The checks above can fail: a misspelt field, a wrong type, an int where KEDA wants a
    string (trigger metadata is a map of strings: `lagCount: 24` is refused by a cluster)."""
    docs = {(doc["kind"], doc["metadata"]["name"]): doc for _, doc in k8s_docs()}
    rollout = copy.deepcopy(docs[("Deployment", "streamrl-rollout")])
    rollout["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 90
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_manifest(rollout)
    rollout = copy.deepcopy(docs[("Deployment", "streamrl-rollout")])
    rollout["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_manifest(rollout)
    scaled = copy.deepcopy(docs[("ScaledObject", "streamrl-rollout")])
    scaled["spec"]["triggers"][0]["metadata"]["lagCount"] = 24
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'string'"):
        validate_manifest(scaled)
    scaled = copy.deepcopy(docs[("ScaledObject", "streamrl-rollout")])
    scaled["spec"]["cooldownPeriodSeconds"] = 300
    with pytest.raises(jsonschema.ValidationError, match="cooldownPeriodSeconds"):
        validate_manifest(scaled)


def test_compose_file_passes_the_compose_spec(tmp_path):
    def check(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
             str(path)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    ok = check(DEPLOY / "docker-compose.yml")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = compose()
    broken["services"]["rollout"]["stop_grace_periods"] = "90s"
    (tmp_path / "compose.yml").write_text(yaml.safe_dump(broken))
    bad = check(tmp_path / "compose.yml")
    assert bad.returncode == 1 and "stop_grace_periods" in bad.stdout + bad.stderr


# ------------------------------------------------------------------- what runs where
def containers() -> list[tuple[str, str, list[str], dict[str, str]]]:
    """(where, image target, argv after the entrypoint, env) of every streamrl container in
    the compose file and the manifests; argv starts with `rq` when rq is the entrypoint."""
    out = []
    services = compose()["services"]
    for name, svc in services.items():
        image = svc.get("image", "")
        m = STREAMRL_IMAGES.match(image)
        if not m:
            continue
        argv = list(svc.get("entrypoint") or []) + list(svc.get("command") or [])
        if not svc.get("entrypoint"):
            argv = ["streamrl", *argv]
        assert svc["build"]["target"] == m.group(1), name
        out.append((f"compose:{name}", m.group(1), argv, dict(svc.get("environment") or {})))
    for file, doc in k8s_docs():
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []):
            m = STREAMRL_IMAGES.match(c["image"])
            if not m:
                continue
            argv = list(c.get("command") or ["streamrl"]) + list(c.get("args") or [])
            env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
            out.append((f"{file}:{doc['metadata']['name']}", m.group(1), argv, env))
    return out


def _rest(ctx: click.Context) -> list[str]:
    return [*getattr(ctx, "_protected_args", []), *ctx.args]


def parse_streamrl(argv: list[str]) -> tuple[str, dict]:
    """Parse ``streamrl ARGV`` with the real click tree (types and choices included) without
    running it; returns the subcommand and its parameters. Raises click.UsageError."""
    from streamrl.cli import main

    with main.make_context("streamrl", list(argv)) as ctx:
        name, cmd, rest = main.resolve_command(ctx, _rest(ctx))
        assert cmd is not None, f"no command {name!r}"
        sub = cmd.make_context(name, rest, parent=ctx)
        return name, sub.params


def parse_rq(argv: list[str]) -> dict:
    from rq.cli import main as rq_main

    with rq_main.make_context("rq", list(argv)) as ctx:
        name, cmd, rest = rq_main.resolve_command(ctx, _rest(ctx))
        assert name == "worker", argv
        return cmd.make_context(name, rest, parent=ctx).params


def test_every_command_and_flag_exists_in_the_cli():
    seen = set()
    for where, _target, argv, _env in containers():
        if argv[0] == "rq":
            params = parse_rq(argv[1:])
            cls = params["worker_class"]
            assert cls == "streamrl.workers.LeaseWorker", where
            module, _, attr = cls.rpartition(".")
            assert hasattr(__import__(module, fromlist=[attr]), attr), where
            assert set(params["queues"]) <= {d.ROLLOUT_QUEUE, d.VERIFY_QUEUE}, where
            seen.add(params["queues"][0])
        else:
            assert argv[0] == "streamrl", where
            name, _params = parse_streamrl(argv[1:])
            seen.add(name)
    # every role of a deployment is somewhere in deploy/
    assert {"learn", "produce", "metrics", d.ROLLOUT_QUEUE, d.VERIFY_QUEUE} <= seen


def test_a_renamed_flag_fails_the_check():
    with pytest.raises(click.NoSuchOption):
        parse_streamrl(["metrics", "--prot", "9464"])
    with pytest.raises(click.UsageError):
        parse_streamrl(["learner", "--config", "configs/copy-tiny.toml"])
    with pytest.raises(click.NoSuchOption):
        parse_rq(["worker", "--worker-klass", "streamrl.workers.LeaseWorker", "srl-rollout"])


def _cli_envvars() -> set[str]:
    from rq.cli import main as rq_main

    from streamrl.cli import main

    names: set[str] = set()

    def walk(cmd: click.Command) -> None:
        if hasattr(cmd, "real"):  # LazyCommand: its options live on the real command
            cmd = cmd.real()
        for p in cmd.params:
            env = getattr(p, "envvar", None)
            names.update([env] if isinstance(env, str) else env or [])
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    walk(main)
    walk(rq_main.commands["worker"])
    return names


def _source_envvars() -> set[str]:
    """STREAMRL_* variables the code reads by name."""
    text = "\n".join(p.read_text() for p in (ROOT / "streamrl").rglob("*.py"))
    return set(re.findall(r"[\"'](STREAMRL_[A-Z_]+)[\"']", text))


def test_every_environment_variable_is_read_by_streamrl_or_rq():
    known = _cli_envvars() | _source_envvars()
    assert {"STREAMRL_REDIS_URL", "STREAMRL_RUN", "RQ_REDIS_URL", "STREAMRL_LOG_FORMAT"} <= known
    for where, _target, _argv, env in containers():
        unknown = set(env) - known
        assert not unknown, f"{where}: {sorted(unknown)} is read by nothing"
    for value in compose()["x-env"].values():
        assert "${" not in value or value.startswith("${STREAMRL_RUN"), value


def test_images_build_only_what_their_roles_need():
    """Targets named in deploy/ exist in the Dockerfile; the `worker` target installs no torch
    and the roles that run on it import and verify with torch and transformers absent."""
    import dockerfile

    stages: dict[str, list] = {}
    current = None
    for c in dockerfile.parse_file(str(DEPLOY / "Dockerfile")):
        if c.cmd.upper() == "FROM":
            current = c.value[2] if len(c.value) == 3 and c.value[1].upper() == "AS" else None
            stages[current or f"stage{len(stages)}"] = []
        else:
            stages[current].append(c)  # type: ignore[index]
    assert {"worker", "train"} <= set(stages)
    for _where, target, _argv, _env in containers():
        assert target in stages
    worker_text = " ".join(" ".join(c.value) for c in stages["worker"])
    assert "torch" not in worker_text and "train" not in worker_text
    assert "torch==2.13.0" in " ".join(" ".join(c.value) for c in stages["train"])
    on_worker = {a[-1] if a[0] == "rq" else a[1] for _, t, a, _ in containers() if t == "worker"}
    assert {d.VERIFY_QUEUE, "metrics", "produce"} <= on_worker
    script = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['transformers'] = None\n"
        "import streamrl.cli, streamrl.ops.metrics, streamrl.workers.lease_worker\n"
        "import streamrl.workers.verify as v, streamrl.workers.rollout, streamrl.policy.openai\n"
        "from streamrl.envs import make_env\n"
        "from streamrl.envs.registry import BUILTIN\n"
        "from streamrl import schema\n"
        "import random\n"
        "for name in BUILTIN: make_env(name)\n"
        "env = make_env('copy')\n"
        "p = env.generate(random.Random(0), 0)\n"
        "t = schema.Task(task_id='p:0', prompt_id='p', k=0, group_size=1, env='copy',\n"
        "                input=p.input, data=p.data)\n"
        "answer = schema.Message(role='assistant', content=' '.join(p.data['answer']))\n"
        "traj = schema.Trajectory(task_id='p:0', prompt_id='p', k=0, group_size=1, env='copy',\n"
        "    items=[*p.input, answer], n_input=len(p.input), turns=[], status='completed',\n"
        "    data=p.data,\n"
        "    state=env.encode_state(env.reset(t)))\n"
        "print(v.verify_one(env, traj, 10, 0).reward)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip().splitlines()[-1]) == 1.0


# ----------------------------------------------------------- the pieces fit together
def test_keda_scales_each_worker_on_its_own_consumer_group():
    docs = k8s_docs()
    deployments = {doc["metadata"]["name"]: doc for _, doc in docs if doc["kind"] == "Deployment"}
    services = {doc["metadata"]["name"]: doc for _, doc in docs if doc["kind"] == "Service"}
    scaled = [doc for _, doc in docs if doc["kind"] == "ScaledObject"]
    keys = Keys(d.DEFAULT_RUN)
    inputs = {d.ROLLOUT_QUEUE: (keys.tasks, d.ROLLOUT_GROUP),
              d.VERIFY_QUEUE: (keys.rollouts, d.VERIFY_GROUP)}  # fmt: skip
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled} == {
        "streamrl-rollout", "streamrl-verify"
    }  # fmt: skip
    for s in scaled:
        spec = s["spec"]
        target = deployments[spec["scaleTargetRef"]["name"]]
        (container,) = target["spec"]["template"]["spec"]["containers"]
        queue = parse_rq(container["command"][1:])["queues"][0]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "redis-streams"
        meta = trigger["metadata"]
        assert (meta["stream"], meta["consumerGroup"]) == inputs[queue]
        host, _, port = meta["address"].partition(":")
        assert host in services and int(port) == services[host]["spec"]["ports"][0]["port"]
        assert 0 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
        assert spec["cooldownPeriod"] > 0 and int(meta["lagCount"]) > 0


def test_grace_periods_let_a_lease_drain():
    """SIGTERM lets the running lease end: up to lease_seconds + drain_seconds by default."""
    need = d.LEASE_SECONDS + d.LEASE_DRAIN_SECONDS
    for _, doc in k8s_docs():
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []):
            if c.get("command", [""])[0] == "rq":
                assert spec["terminationGracePeriodSeconds"] > need, doc["metadata"]["name"]
    for name in ("rollout", "verify"):
        grace = compose()["services"][name]["stop_grace_period"]
        assert int(grace.rstrip("s")) > need, name


def test_prometheus_scrapes_the_exporter():
    c = compose()
    config = yaml.safe_load(c["configs"]["prometheus"]["content"])
    (job,) = config["scrape_configs"]
    (target,) = job["static_configs"][0]["targets"]
    host, _, port = target.partition(":")
    _, params = parse_streamrl(c["services"][host]["command"])
    assert int(port) == params["port"]
    for _, doc in k8s_docs():
        if doc["metadata"]["name"] == "streamrl-metrics" and doc["kind"] == "Deployment":
            pod = doc["spec"]["template"]
            (container,) = pod["spec"]["containers"]
            _, params = parse_streamrl(container["args"])
            assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(params["port"])


def test_dashboard_uses_only_exported_metrics():
    from streamrl.ops.metric_families import Families

    exported = set()
    for family in vars(Families()).values():
        name = family.name + ("_total" if family.type == "counter" else "")
        exported.add(name)
        if family.type == "histogram":
            exported |= {f"{family.name}_{s}" for s in ("bucket", "sum", "count")}
    exported |= {"streamrl_redis_up", "streamrl_scrape_duration_seconds"}
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "streamrl.json").read_text())
    used = set()
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            used |= set(re.findall(r"\bstreamrl_[a-z_]+", t["expr"]))
    assert used and used <= exported, used - exported
    assert {"streamrl_consumer_group_lag", "streamrl_groups_dropped_total",
            "streamrl_rq_workers", "streamrl_reward_bucket"} <= used  # fmt: skip
