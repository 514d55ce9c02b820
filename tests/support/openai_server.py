"""A small OpenAI-compatible server that speaks vLLM's dialect, for tests and demos.

It serves a transformers model (the tiny one in tests) with real sampling, in a thread of the
calling process, on a free port, using only the standard library's ``http.server``. It stands
in for a GPU ``vllm serve`` so that the real ``openai`` backend is what gets tested; the
response shapes follow vLLM's ``ChatCompletionResponse`` (``prompt_token_ids``,
``choices[0].token_ids``, ``logprobs.content[].{token, logprob}``, ``token_id:N`` tokens)
and its error bodies. What it implements:

- ``GET /v1/models``; ``POST /v1/chat/completions`` (non-streaming, ``n = 1``), log-probs as
  vLLM's ``--logprobs-mode processed_logprobs`` (after temperature), eos in ``token_ids`` but
  not in the text, ``skip_special_tokens`` honoured (default true, as in vLLM);
- ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (peft; each adapter is served
  under its own model name);
- ``POST /collective_rpc`` with ``streamrl_load_weights`` (what ``vllm_ext.WeightLoader``
  does inside vLLM) or ``reload_weights`` (``kwargs.weights_path``); ``/pause``, ``/resume``,
  ``/reset_prefix_cache`` (recorded);
- fault injection (``fail_next``) and a ``script`` hook returning fixed completion text
  where generation is not the point.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from streamrl.policy.vllm_ext import iter_safetensors


class OpenAITestServer:
    """``with OpenAITestServer(model_dir) as server: server.url``"""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        served_model_name: str = "tiny",
        version_header: bool = False,
        script: Callable[[dict[str, Any]], str] | None = None,
        delay_s: float = 0.0,
        port: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.served_model_name = served_model_name
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.base = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
        self.adapters: dict[str, Any] = {}
        self.weights_version = 0  # bumped per weight load; sent as x-policy-version if asked
        self.version_header = version_header
        self.script = script
        self.chat_requests: list[dict[str, Any]] = []
        self.control_calls: list[str] = []
        self.reset_refusals = 0  # /reset_prefix_cache answers {"success": false} this often
        self.events: list[str] = []  # chat start/end and control calls, in arrival order
        self.delay_s = delay_s  # per chat request: keeps requests in flight for ordering tests
        self.rpc_delay_s = 0.0  # per weight load: keeps a swap running for cancellation tests
        self._failures: list[int] = []
        self._lock = threading.Lock()  # one generation at a time (global torch RNG)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), self.handler_class())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> OpenAITestServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def handler_class(self) -> type[BaseHTTPRequestHandler]:
        """The request handler (a subclass adds its own endpoints by extending it)."""
        return _handler(self)

    def fail_next(self, n: int, status: int = 503) -> None:
        """The next ``n`` chat requests get ``status`` (a transient error unless 4xx)."""
        self._failures.extend([status] * n)

    # ------------------------------------------------------------------ endpoints

    def models(self) -> dict[str, Any]:
        names = [self.served_model_name, *self.adapters]
        data = [{"id": n, "object": "model", "owned_by": "vllm"} for n in names]
        return {"object": "list", "data": data}

    def chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.events.append("chat-start")
        try:
            return self._chat(body)
        finally:
            self.events.append("chat-end")

    def _chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.chat_requests.append(body)
        if self.delay_s:
            time.sleep(self.delay_s)
        if self._failures:
            status = self._failures.pop(0)
            return status, _error(status, "injected failure")
        name = body.get("model")
        if name == self.served_model_name:
            model = self.base
        elif name in self.adapters:
            model = self.adapters[name]
        else:
            return 404, _error(404, f"The model `{name}` does not exist.")
        messages = body["messages"]
        kwargs = {"tools": body["tools"]} if body.get("tools") else {}
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        prompt = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        if self.script is not None:
            content = self.script(body)
            tokens = list(range(len(content.split())))
            logprobs = [-1.0] * len(tokens)
            finish = "stop"
        else:
            tokens, logprobs, finish = self._sample(
                model, prompt, max_tokens, float(body.get("temperature", 1.0)), body.get("seed")
            )
            eos = self.tokenizer.eos_token_id
            text_ids = tokens[:-1] if finish == "stop" and tokens[-1] == eos else tokens
            content = self.tokenizer.decode(
                text_ids, skip_special_tokens=bool(body.get("skip_special_tokens", True))
            )
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": content, "tool_calls": []},
            "finish_reason": finish,
            "stop_reason": None,
        }
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {
                        "token": f"token_id:{t}" if as_ids else self.tokenizer.decode([t]),
                        "logprob": lp,
                        "bytes": None,
                        "top_logprobs": [],
                    }
                    for t, lp in zip(tokens, logprobs, strict=True)
                ]
            }
        response: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(tokens),
                "total_tokens": len(prompt) + len(tokens),
            },
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = tokens
            response["prompt_token_ids"] = prompt
        return 200, response

    def _sample(
        self, model: Any, prompt: list[int], max_tokens: int, temperature: float, seed: Any
    ) -> tuple[list[int], list[float], str]:
        """transformers sampling; the log-probs are those of the processed (tempered)
        distribution the tokens were drawn from."""
        import torch

        eos = self.tokenizer.eos_token_id
        with self._lock, torch.inference_mode():
            if seed is not None:
                torch.manual_seed(int(seed))
            out = model.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_tokens,
                eos_token_id=eos,
                pad_token_id=self.tokenizer.pad_token_id,
                output_scores=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = [
            torch.log_softmax(score[0].float(), dim=-1)[t].item()
            for score, t in zip(out.scores, tokens, strict=False)
        ]
        tokens = tokens[: len(logprobs)]
        finish = "stop" if tokens and tokens[-1] == eos else "length"
        return tokens, logprobs, finish

    def load_lora(self, body: dict[str, Any]) -> tuple[int, Any]:
        from peft import PeftModel

        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return 400, _error(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.adapters:
            return 400, _error(400, f"The lora adapter '{name}' has already been loaded.")
        with self._lock:
            self.adapters[name] = PeftModel.from_pretrained(copy.deepcopy(self.base), path).eval()
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora(self, body: dict[str, Any]) -> tuple[int, Any]:
        name = body.get("lora_name")
        if name not in self.adapters:
            return 404, _error(404, f"The lora adapter '{name}' cannot be found.")
        del self.adapters[name]
        return 200, f"Success: LoRA adapter '{name}' removed successfully."

    def collective_rpc(self, body: dict[str, Any]) -> tuple[int, Any]:
        method = body.get("method")
        self.events.append(f"rpc:{method}")
        if method == "streamrl_load_weights":
            directory = (body.get("args") or [None])[0]
        elif method == "reload_weights":
            directory = (body.get("kwargs") or {}).get("weights_path")
        else:
            return 400, _error(400, f"unknown method {method!r}")
        time.sleep(self.rpc_delay_s)
        try:
            state = dict(iter_safetensors(directory))
        except OSError as e:  # vLLM's answer when its worker raises
            return 500, _error(500, f"{type(e).__name__}: {e}")
        with self._lock:
            self.base.load_state_dict(state, strict=False)
            self.weights_version += 1
        return 200, {"results": [len(state)]}


def _error(status: int, message: str) -> dict[str, Any]:
    """vLLM's error body."""
    kind = HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def _handler(server: OpenAITestServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the client's pool reuses connections

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, payload: Any) -> None:
            if isinstance(payload, str):
                data, kind = payload.encode(), "text/plain; charset=utf-8"
            else:
                data, kind = json.dumps(payload).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            if server.version_header:
                self.send_header("x-policy-version", str(server.weights_version))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if urlsplit(self.path).path == "/v1/models":
                self._send(200, server.models())
            else:
                self._send(404, _error(404, "Not Found"))

        def do_POST(self) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                self._send(400, _error(400, "Invalid JSON"))
                return
            routes: dict[str, Callable[[dict[str, Any]], tuple[int, Any]]] = {
                "/v1/chat/completions": server.chat,
                "/v1/load_lora_adapter": server.load_lora,
                "/v1/unload_lora_adapter": server.unload_lora,
                "/collective_rpc": server.collective_rpc,
            }
            if url.path in routes:
                status, payload = routes[url.path](body)
            elif url.path in ("/pause", "/resume", "/reset_prefix_cache"):
                query = parse_qs(url.query)
                mode = f"?mode={query['mode'][0]}" if "mode" in query else ""
                server.control_calls.append(url.path + mode)
                server.events.append(url.path)
                status, payload = 200, {"status": url.path.strip("/")}
                if url.path == "/reset_prefix_cache":  # vLLM's answer; refused while held
                    payload = {"success": server.reset_refusals <= 0}
                    server.reset_refusals -= 1
            else:
                status, payload = 404, _error(404, "Not Found")
            self._send(status, payload)

    return Handler
