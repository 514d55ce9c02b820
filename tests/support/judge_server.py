"""A judge endpoint for tests: a real process serving ``POST /v1/chat/completions`` with a real
(tiny, randomly initialised) transformers model that samples its answer, so that tests can
SIGKILL it and start it again on the same port.

The model's vocabulary holds the digits, ``Score:`` and the tokenizer's specials; every other
word of a rubric reads as ``<unk>``. Sampling at temperature 1, its first few tokens hold a
digit most of the time and none some of the time: a judge config reads the first digit
(``score_pattern = "(\\d)"``) and meets real unparseable answers now and then.

Knobs, ``POST /admin`` with a JSON object: ``fail_next`` (answer the next N chat requests with
``status``, 429 by default, and a ``Retry-After: <retry_after>`` header when ``retry_after`` is
given), ``fail_all`` (answer every chat request with this status, and ``retry_after``, until
it is null again), ``hang`` (true: chat requests wait until it is false again or their client
goes away, as vLLM aborts a request whose client disconnected), ``hang_after`` (N: answer the
next N chat requests, then hang every later one until its client goes), ``delay_s`` (each request
waits this long first, keeping requests in flight side by side), ``reply`` (answer every chat
request with this text instead of the model's sample, as a judge swapped behind the same URL
would; null: the model again), ``reset_max`` (start counting ``max_in_flight`` again).
``GET /stats``:
``calls`` (chat requests received), ``statuses`` (answers by HTTP status), ``in_flight`` and
``max_in_flight`` (chat requests being handled at once: now, and the most ever seen), ``log``
(``[arrival, status]`` of the last chat requests, arrival in seconds on the server's clock).

    python -m tests.support.judge_server MODEL_DIR PORT [DELAY_S]
"""

from __future__ import annotations

import json
import select
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.support.openai_server import OpenAITestServer, _error

WORDS = ["<pad>", "<bos>", "<eos>", "<unk>", "<user>", "<assistant>", "Score:",
         *[str(i) for i in range(10)]]  # fmt: skip
SERVED = "judge-tiny"


def save_judge_model(directory: str | Path, seed: int = 0) -> Path:
    """A judge-sized tiny Llama and its word-level tokenizer (the digits in its vocabulary,
    512 positions for a rubric), written as a normal HF directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from streamrl.models.tiny import build_tokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=WORDS.index("<bos>"),
        eos_token_id=WORDS.index("<eos>"),
        pad_token_id=WORDS.index("<pad>"),
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    build_tokenizer(WORDS).save_pretrained(directory)
    return directory


class JudgeTestServer(OpenAITestServer):
    def __init__(self, model_dir: str | Path, port: int, delay_s: float = 0.0) -> None:
        super().__init__(model_dir, served_model_name=SERVED, port=port)
        self.hold_s = delay_s
        self.hang = False
        self.hang_after: int | None = None
        self.fail: list[tuple[int, str | None]] = []  # (status, Retry-After)
        self.fail_all: tuple[int, str | None] | None = None
        self.stats: dict[str, Any] = {"calls": 0, "statuses": {}, "in_flight": 0}
        self.stats["max_in_flight"] = 0
        self.stats["log"] = []
        self._count = threading.Lock()

    def admin(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._count:
            after = body.get("retry_after")
            after = None if after is None else str(after)
            if "fail_next" in body:
                self.fail += [(int(body.get("status", 429)), after)] * int(body["fail_next"])
            if "fail_all" in body:
                self.fail_all = None if body["fail_all"] is None else (int(body["fail_all"]), after)
            if "hang" in body:
                self.hang = bool(body["hang"])
            if "hang_after" in body:
                self.hang_after = body["hang_after"]
            if "delay_s" in body:
                self.hold_s = float(body["delay_s"])
            if "reply" in body:
                reply = body["reply"]
                self.script = None if reply is None else (lambda _body: str(reply))
            if body.get("reset_max"):
                self.stats["max_in_flight"] = self.stats["in_flight"]
        return {"ok": True}

    def judge_call(
        self, body: dict[str, Any], conn: socket.socket
    ) -> tuple[int, Any, dict[str, str]] | None:
        """A chat request, counted in flight from arrival to answer: its status, body and
        extra headers; None: its client left."""
        arrival = time.monotonic()
        with self._count:
            self.stats["calls"] += 1
            self.stats["in_flight"] += 1
            self.stats["max_in_flight"] = max(self.stats["max_in_flight"], self.stats["in_flight"])
            status, after = self.fail.pop(0) if self.fail else self.fail_all or (0, None)
            hang = self.hang_after == 0
            if self.hang_after:
                self.hang_after -= 1
        answer: tuple[int, Any, dict[str, str]] | None = None
        try:
            if status:
                headers = {"Retry-After": after} if after is not None else {}
                answer = status, _error(status, "injected failure"), headers
                return answer
            until = time.monotonic() + self.hold_s
            while hang or self.hang or time.monotonic() < until:
                if _client_gone(conn):
                    return None
            answer = (*self.chat(body), {})
            return answer
        finally:
            with self._count:
                self.stats["in_flight"] -= 1
                if answer is not None:
                    self.stats["log"] = [*self.stats["log"][-499:], [arrival, answer[0]]]

    def handler_class(self) -> type:
        server = self
        base = super().handler_class()

        class Handler(base):  # type: ignore[misc, valid-type]
            def do_GET(self) -> None:
                if self.path == "/stats":
                    with server._count:
                        self._send(200, json.loads(json.dumps(server.stats)))
                else:
                    super().do_GET()

            def do_POST(self) -> None:
                if self.path not in ("/admin", "/v1/chat/completions"):
                    super().do_POST()
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path == "/admin":
                    self._send(200, server.admin(body))
                    return
                answer = server.judge_call(body, self.connection)
                if answer is None:
                    self.close_connection = True
                    return
                status, payload, headers = answer
                with server._count:
                    codes = server.stats["statuses"]
                    codes[str(status)] = codes.get(str(status), 0) + 1
                self._headers = headers
                self._send(status, payload)

            def end_headers(self) -> None:
                for name, value in getattr(self, "_headers", {}).items():
                    self.send_header(name, value)
                self._headers = {}
                super().end_headers()

        return Handler


def _client_gone(conn: socket.socket, wait_s: float = 0.02) -> bool:
    """Whether the client closed its end (a readable socket with nothing to read)."""
    readable, _, _ = select.select([conn], [], [], wait_s)
    if not readable:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def main(argv: list[str]) -> None:
    model_dir, port = argv[0], int(argv[1])
    delay = float(argv[2]) if len(argv) > 2 else 0.0
    server = JudgeTestServer(model_dir, port, delay)
    print(f"judge server on {server.url}", flush=True)
    server._httpd.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
