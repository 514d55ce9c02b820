"""``streamrl view`` against a real run: a private redis-server with a password, real rq
workers scoring a counter run (tool calls, malformed calls, wrong answers), a copy task whose
completion is hostile HTML, and a dataset row that is dead-lettered.

The HTTP test checks what any client gets: no password in any page, model text escaped,
refused Host names, bad filters as one line, unknown entries as 404. The browser test drives
the page in Debian's chromium with Playwright: the chart follows new rewards, a search finds a
known trajectory, the hostile completion shows as text and runs nothing, a dead letter links
to its entry, and the page shows Redis going away and comes back when it returns. It needs
``apt-get install chromium`` and ``pip install playwright`` (in the dev extra) and skips,
saying which is missing, without them. ``STREAMRL_SCREENSHOTS=docs/img`` makes it write the
README's two screenshots there (else they go to the test's temporary directory)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis

from streamrl.config import PolicyConfig, RunConfig
from streamrl.envs import make_env
from streamrl.local.embedded import EmbeddedRedis, free_port
from streamrl.local.pipeline import LocalPipeline
from streamrl.producer.produce import Producer
from tests.support.waiting import wait_for

pytest.importorskip(
    "starlette", reason="streamrl view needs the view extra: pip install -e '.[view]'"
)

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "s3cret-view-pw"
RUN = "exp"
HOSTILE = "<script>window.__pwned=1</script>"
CHROMIUM = "/usr/bin/chromium"


class _Run:
    def __init__(self, server: EmbeddedRedis, pipeline: LocalPipeline, url: str, view: str):
        self.server, self.pipeline, self.url, self.view = server, pipeline, url, view

    def restart_redis(self) -> None:
        """Stop our own redis-server and start it again from its AOF, on the same port."""
        self.server.stop()
        self.server.start()
        _protect(self.server)


def _protect(server: EmbeddedRedis) -> None:
    redis.Redis.from_url(server.url).config_set("requirepass", PASSWORD)


@pytest.fixture(scope="module")
def viewed_run(tmp_path_factory):
    """The run, and `streamrl view` on it (the URL it answers on)."""
    where = tmp_path_factory.mktemp("view")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env["STREAMRL_PYTHON"] = sys.executable
    with EmbeddedRedis(where / "redis", durable=True) as server:
        _protect(server)
        url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
        policy = PolicyConfig(wrong_rate=0.5, malformed_rate=0.25)
        cfg = RunConfig(run=RUN, env="counter", group_size=4, policy=policy)
        with LocalPipeline(cfg, url=url, directory=where, worker_env=env) as p:
            p.start_workers(1, 1)
            Producer(p.r, RUN).from_env(make_env("counter"), 8, 4, seed=5)
            rows = where / "rows.jsonl"
            hostile = {"id": "hostile", "env": "copy", "input": "copy : it", "answer": [HOSTILE]}
            rows.write_text(json.dumps(hostile) + "\n{not json\n")
            Producer(p.r, RUN).from_jsonl(rows, "counter", 4)
            p.wait_groups(9)
            port = free_port()
            argv = ["--redis", url, "--run", RUN, "view", "--port", str(port)]
            log = open(where / "view.log", "w")  # noqa: SIM115 - closed below
            proc = subprocess.Popen(
                [sys.executable, "-m", "streamrl.cli", *argv],
                env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            base = f"http://127.0.0.1:{port}"
            try:
                wait_for(lambda: _get(base + "/api/live")[0] == 200, "streamrl view to answer",
                         timeout=60, ignore=(OSError,))  # fmt: skip
                yield _Run(server, p, url, base)
            finally:
                proc.terminate()
                proc.wait(timeout=20)
                log.close()


def _get(url: str, host: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(req, timeout=20) as res:
            return res.status, res.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _group_ids(run: _Run) -> list[str]:
    return [eid.decode() for eid, _ in run.pipeline.r.xrange(run.pipeline.keys.groups)]


def test_pages_escape_model_text_and_never_show_the_password(viewed_run):
    run, seen = viewed_run, []
    status, live = _get(run.view + "/api/live")
    assert status == 200
    data = json.loads(live)
    assert sum(data["chart"]["samples"]) == 36 and data["chart"]["versions"] == [0]
    seen.append(live)
    status, found = _get(run.view + "/samples?prompt=hostile")
    assert status == 200 and found.count('class="sample-link"') == 4
    seen.append(found)
    group = next(g for g in _group_ids(run) if "hostile" in _get(f"{run.view}/group/0/{g}")[1])
    status, page = _get(f"{run.view}/group/0/{group}")
    assert status == 200 and HOSTILE not in page
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in page  # shown, escaped
    seen.append(page)
    for path in ("/", "/samples", "/samples?min_reward=1&env=counter", f"/sample/0/{group}/0"):
        status, page = _get(run.view + path)
        assert status == 200, (path, page)
        seen.append(page)
    status, page = _get(run.view + "/samples?min_reward=lots")
    assert status == 200 and "min_reward: &#39;lots&#39; is not a number" in page
    status, page = _get(run.view + "/samples?before=yesterday")
    assert status == 200 and "before: &#39;yesterday&#39; is not a stream entry ID" in page
    assert _get(run.view + "/sample/0/1-1/0")[0] == 404
    assert _get(run.view + "/group/7/1-1")[0] == 404
    assert _get(run.view + "/", host="evil.example")[0] == 400  # DNS rebinding: refused
    assert all(PASSWORD not in page for page in seen)
    assert "redis://:***@127.0.0.1" in seen[-1]  # the footer names the Redis, masked


def _browser():
    """Playwright's Chromium driving Debian's chromium, or a skip that says what is missing."""
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="the browser test needs playwright: pip install playwright",
        exc_type=ImportError,
    )
    if not (os.access(CHROMIUM, os.X_OK) or shutil.which("chromium")):
        pytest.skip("the browser test needs Debian's chromium: apt-get install chromium")
    return sync_api


def _until(page, js: str, what: str, timeout: float = 60) -> None:
    """Poll a JavaScript expression in the page (the page's CSP forbids Playwright's own
    string predicates, which it evaluates with eval)."""
    wait_for(lambda: page.evaluate(js), what, timeout=timeout, every=0.1)


def test_in_a_real_browser(viewed_run, tmp_path):
    sync_api = _browser()
    run = viewed_run
    shots = Path(os.environ.get("STREAMRL_SCREENSHOTS") or tmp_path)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM if os.access(CHROMIUM, os.X_OK) else shutil.which("chromium"),
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        ran: list[str] = []
        page.on("console", lambda m: ran.append(m.text))
        seen = []

        # the live page: the chart follows rewards as they are scored
        page.goto(run.view + "/")
        samples = "document.getElementById('chart').dataset.samples"
        _until(page, f"{samples} === '36'", "the chart to show the 36 scored samples")
        assert page.locator("#chart canvas").count() == 1
        Producer(run.pipeline.r, RUN).from_env(make_env("counter"), 12, 4, seed=5)  # 4 more
        _until(page, f"{samples} === '52'", "the chart to follow 16 more scored samples")
        assert page.locator("#versions tbody tr").count() == 1
        page.locator("#stages").wait_for()
        page.screenshot(path=str(shots / "view_live.png"), full_page=True)
        seen.append(page.content())

        # a dead letter links to its entry: the dataset row that did not parse
        page.locator("#dead-letters a").first.click()
        assert "not JSON" in page.locator("td.error").inner_text()
        assert "{not json" in page.locator("pre.text").inner_text()

        # a search finds a known trajectory; its episode reads as a conversation
        page.goto(run.view + "/samples")
        page.fill("input[name=prompt]", "counter-s5-0000003")
        page.click("button[type=submit]")
        # count() does not wait: wait for the results page to load, not just to commit
        page.wait_for_url(lambda url: "prompt=counter-s5-0000003" in url)
        links = page.locator("a.sample-link")
        assert links.count() == 4
        assert set(links.all_inner_texts()) == {f"counter-s5-0000003:{k}" for k in range(4)}
        links.first.click()
        page.locator("li.function_call").first.wait_for()
        assert "add" in page.locator("li.function_call code").first.inner_text()
        assert page.locator("li.function_call_output").count() >= 1
        seen.append(page.content())
        group = page.locator("a", has_text="its group")
        group.click()
        page.wait_for_url(lambda url: "/group/" in url)
        assert page.locator("#best").count() == 1 and page.locator("#worst").count() == 1
        page.goto(run.view + "/samples?text=n%3A+")  # the malformed calls: `{n: `
        page.locator("a.sample-link").first.click()
        page.locator("li.has-error").first.wait_for()
        page.screenshot(path=str(shots / "view_trajectory.png"), full_page=True)
        seen.append(page.content())

        # hostile model text shows as text and runs nothing, even with the page's Content
        # Security Policy switched off: escaping alone keeps it inert
        bare = browser.new_page(bypass_csp=True)
        bare.goto(run.view + "/samples?prompt=hostile")
        bare.locator("a.sample-link").first.click()
        answer = bare.locator("li.role-assistant pre.text").last
        assert answer.inner_text().startswith(HOSTILE)  # a wrong sample adds " (or so)"
        assert bare.evaluate("typeof window.__pwned") == "undefined"
        assert bare.locator("main script").count() == 0
        seen.append(bare.content())
        bare.close()

        # Redis goes away: the page says so; Redis comes back: the page recovers
        page.goto(run.view + "/")
        _until(page, "document.body.dataset.updated !== undefined", "a first live event")
        run.server.stop()
        problem = page.locator("#problem")
        problem.wait_for(state="visible", timeout=30_000)
        assert "cannot read Redis" in problem.inner_text()
        seen.append(problem.inner_text())
        run.server.start()
        _protect(run.server)
        before = float(page.evaluate("document.body.dataset.updated"))
        _until(
            page,
            f"Number(document.body.dataset.updated) > {before}"
            " && document.getElementById('problem').hidden",
            "the page to recover after Redis came back",
        )
        assert page.evaluate(samples) == "52"
        assert all(PASSWORD not in text for text in seen)
        assert not [m for m in ran if "Content Security Policy" in m], ran
        browser.close()
