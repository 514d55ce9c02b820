"""``streamrl view``: a local web page of one run, served by Starlette and uvicorn.

Routes: ``/`` the live page (its panel and chart pushed by server-sent events on
``/events``, also as JSON on ``/api/live``), ``/samples`` the trajectory search,
``/sample/<shard>/<entry>/<k>`` one episode, ``/group/<shard>/<entry>`` a group best against
worst, ``/dead/<shard>/<entry>`` a dead letter and the entry it carried.

What keeps it from leaking: it binds 127.0.0.1 unless told otherwise and answers only requests
whose Host is that address (a web page elsewhere cannot read it through DNS rebinding); every
page is a Jinja2 template with autoescaping, so model text is shown, never run; the Content
Security Policy allows only this server's own scripts, so even an unescaped ``<script>`` would
not run; the Redis URL is never given to a template, and error text passes through
``connection.redact``. Redis is read with a client that does not retry for minutes: while it
is down every page says so at once and the live page keeps polling until it answers again.
"""

from __future__ import annotations

import json
import math
import socket
import time
from pathlib import Path
from typing import Any

import anyio
import jinja2
import redis
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from streamrl import schema
from streamrl.bus.shards import run_shards
from streamrl.connection import redact
from streamrl.ops.status import collect
from streamrl.ops.web import browse
from streamrl.ops.web.conversation import Turn, conversation
from streamrl.ops.web.feed import RewardFeed

HERE = Path(__file__).parent
LIVE_INTERVAL_S = 1.0
_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; script-src 'self'; object-src 'none'; "
     b"base-uri 'none'; frame-ancestors 'none'; form-action 'self'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]  # fmt: skip


class _SecurityHeaders:
    """Adds the headers above to every response (a plain ASGI middleware: it leaves the
    server-sent event stream unbuffered)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], *_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,  # every {{ }} is escaped, whatever the template's name
    )
    env.filters["reward"] = lambda v: "failed" if v is None else f"{v:.3g}"
    env.filters["when"] = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t or 0))
    env.filters["tojson_text"] = lambda v: json.dumps(v, indent=2, ensure_ascii=False)
    return env


class View:
    """One run's pages over one Redis client (thread-safe; sync handlers run in a pool)."""

    def __init__(self, r: Any, run: str, control: Any = None, where: str = ""):
        self.r = r
        self.run = run
        self.control = control
        self.where = redact(where)  # shown in the footer; never with a password
        self.feed = RewardFeed(run)
        self.env = _environment()

    def page(self, name: str, status: int = 200, **values: Any) -> HTMLResponse:
        html = self.env.get_template(name).render(run=self.run, where=self.where, **values)
        return HTMLResponse(html, status_code=status)

    # ------------------------------------------------------------ live page

    def live(self) -> dict[str, Any]:
        """The chart's data and the panel's HTML: what one server-sent event carries."""
        self.feed.poll(self.r)
        chart = self.feed.snapshot()
        info = collect(self.r, self.run, control=self.control)
        dead = browse.dead_letters(self.r, self.run)
        panel = self.env.get_template("_panel.html").render(info=info, chart=chart, dead=dead)
        return {"chart": chart, "panel": panel, "at": time.time()}

    def index(self, request: Request) -> Response:
        return self.page("live.html", live=self.live())

    def api_live(self, request: Request) -> Response:
        return JSONResponse(self.live())

    async def events(self, request: Request) -> Response:
        async def stream():
            while True:
                try:
                    data = await anyio.to_thread.run_sync(self.live)
                    yield {"event": "live", "data": json.dumps(data)}
                except redis.RedisError as e:
                    yield {"event": "problem", "data": json.dumps({"error": _problem(e)})}
                await anyio.sleep(LIVE_INTERVAL_S)

        return EventSourceResponse(stream(), ping=15)

    # ------------------------------------------------------------ trajectories

    def samples(self, request: Request) -> Response:
        p = request.query_params
        form = {k: p.get(k, "").strip() for k in _QUERY_FIELDS}
        problems: list[str] = []
        q = browse.Query(
            prompt=form["prompt"],
            env=form["env"],
            verifier_version=form["verifier_version"],
            text=form["text"],
            version=_number(form, "version", int, problems),
            min_reward=_number(form, "min_reward", float, problems),
            max_reward=_number(form, "max_reward", float, problems),
        )
        cursor = p.get("before") or None
        try:
            browse.parse_cursor(cursor, len(run_shards(self.r, self.run)))
        except ValueError as e:
            problems.append(f"before: {e}")
            cursor = None
        page = browse.search(self.r, self.run, q, cursor) if not problems else browse.Page()
        more = {**{k: v for k, v in form.items() if v}, "before": page.next_cursor or ""}
        return self.page(
            "samples.html", form=form, page=page, problems=problems, more=more,
            limits={"page": browse.PAGE_SAMPLES, "scan": browse.SCAN_LIMIT},
        )  # fmt: skip

    def sample(self, request: Request) -> Response:
        shard, eid = int(request.path_params["shard"]), request.path_params["entry"]
        k = int(request.path_params["k"])
        group = browse.group(self.r, self.run, shard, eid)
        found = [s for s in group.samples if s.score.k == k]
        if not found:
            raise browse.NotFound(f"group {eid} has no sample {k}")
        s = found[0]
        return self.page(
            "sample.html", shard=shard, entry=eid, group=group, s=s,
            turns=conversation(s.trajectory),
        )  # fmt: skip

    def group(self, request: Request) -> Response:
        shard, eid = int(request.path_params["shard"]), request.path_params["entry"]
        group = browse.group(self.r, self.run, shard, eid)
        ranked = browse.ranked(group)
        best, worst = ranked[0], ranked[-1]
        return self.page(
            "group.html", shard=shard, entry=eid, group=group, ranked=ranked,
            best=best, worst=worst,
            best_turns=conversation(best.trajectory), worst_turns=conversation(worst.trajectory),
        )  # fmt: skip

    def dead(self, request: Request) -> Response:
        shard, eid = int(request.path_params["shard"]), request.path_params["entry"]
        d = browse.dead_letter(self.r, self.run, shard, eid)
        carried = browse.dead_payload(d.letter) if d.letter else None
        turns = []
        if isinstance(carried, schema.Trajectory):
            turns = conversation(carried)
        elif isinstance(carried, schema.Task):  # its input, as a conversation
            turns = _task_turns(carried)
        raw = ""
        if d.letter and d.letter.payload and carried is None:
            raw = d.letter.payload.decode("utf-8", errors="replace")
        prompt = (d.letter.task_id.rpartition(":")[0] if d.letter else "") or ""
        return self.page(
            "dead.html", shard=shard, entry=eid, d=d, carried=carried, turns=turns, raw=raw,
            prompt=prompt,
        )  # fmt: skip


_QUERY_FIELDS = ("prompt", "env", "verifier_version", "version", "min_reward", "max_reward", "text")


def _number(form: dict[str, str], name: str, kind: type, problems: list[str]) -> Any:
    if not form[name]:
        return None
    try:
        value = kind(form[name])
    except ValueError:
        problems.append(f"{name}: {form[name]!r} is not a number")
        return None
    if isinstance(value, float) and not math.isfinite(value):
        problems.append(f"{name}: {form[name]!r} is not a finite number")
        return None
    return value


def _task_turns(task: schema.Task) -> list[Turn]:
    traj = schema.Trajectory(
        task_id=task.task_id, prompt_id=task.prompt_id, k=task.k, group_size=task.group_size,
        env=task.env, items=list(task.input), n_input=len(task.input), turns=[],
        status="failed",
    )  # fmt: skip
    return conversation(traj)


def _problem(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return redact(f"cannot read Redis ({type(e).__name__}): {text}")


def make_app(
    r: Any, run: str, control: Any = None, where: str = "", hosts: list[str] | None = None
) -> Starlette:
    """The app for ``run`` on client ``r``; ``hosts``: the Host names it answers (the
    address it listens on, by default the loopback names)."""
    view = View(r, run, control, where)

    async def redis_down(request: Request, exc: Exception) -> Response:
        return view.page("error.html", status=503, problem=_problem(exc), refresh=True)

    async def not_found(request: Request, exc: Exception) -> Response:
        return view.page("error.html", status=404, problem=str(exc), refresh=False)

    routes = [
        Route("/", view.index),
        Route("/api/live", view.api_live),
        Route("/events", view.events),
        Route("/samples", view.samples),
        Route("/sample/{shard:int}/{entry}/{k:int}", view.sample),
        Route("/group/{shard:int}/{entry}", view.group),
        Route("/dead/{shard:int}/{entry}", view.dead),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    allowed = hosts or ["127.0.0.1", "localhost", "[::1]"]
    return Starlette(
        routes=routes,
        middleware=[
            Middleware(_SecurityHeaders),
            Middleware(TrustedHostMiddleware, allowed_hosts=allowed),
        ],
        exception_handlers={redis.RedisError: redis_down, browse.NotFound: not_found},
    )


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free one), so the command can say where it is before
    serving, and a port in use is one clear error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(app: Starlette, sock: socket.socket) -> None:
    """Serve until Ctrl-C or SIGTERM (uvicorn's own handlers)."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[sock])
