"""What one policy version costs a vLLM server: the ``openai`` backend's full-weight update
(``/pause?mode=wait``, vLLM's ``reload_weights`` from the published safetensors through
``/collective_rpc``, ``/update_weight_version``, ``/weight_info`` check, ``/resume``), timed
end to end from the client, for SmolLM2-135M-Instruct (float32, 538 MB of safetensors).

    python bench/vllm_weight_sync.py [--versions 10] [--cpus 0-1] [--url http://127.0.0.1:8000]

Versions are written as the learner writes them (``model.save_pretrained`` layout, the final
norm scaled so every version differs) and loaded in turn; the server must say the new label
after each. Starts (and stops, by PID) a server of its own unless ``--url`` names one started
with ``VLLM_SERVER_DEV_MODE=1``. Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from streamrl.config import PolicyConfig
from streamrl.local.vllm import VLLMServer, cached_smollm2
from streamrl.policy.openai import OpenAIPolicy
from streamrl.schema import PolicyVersion
from tests.support.vllm import new_version


async def sync_all(url: str, dirs: list[Path]) -> list[float]:
    config = PolicyConfig(backend="openai", base_url=url + "/v1", model="policy",
                          options={"trust_env": False})  # fmt: skip
    policy = OpenAIPolicy(config, None)
    times = []
    for v, d in enumerate(dirs, start=1):
        t = time.perf_counter()
        await policy.load_version(PolicyVersion(version=v, path=str(d)))
        times.append(time.perf_counter() - t)
    await policy.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--cpus", default="", help="vLLM's cores (default: all)")
    ap.add_argument("--url", default="", help="a running server instead of a new one")
    args = ap.parse_args()
    base = cached_smollm2()
    work = Path(tempfile.mkdtemp(prefix="vllm-sync-"))
    try:
        dirs = [new_version(base, work / f"v{i}", 1.0 + 0.01 * i) for i in range(1, 11)]
        dirs = [dirs[i % len(dirs)] for i in range(args.versions)]
        server = None if args.url else VLLMServer(base, cpus=args.cpus).start().wait_ready()
        url = args.url or server.url  # type: ignore[union-attr]
        try:
            times = asyncio.run(sync_all(url, dirs))
            with urllib.request.urlopen(url + "/weight_info") as resp:
                label = json.loads(resp.read())["weight_version"]
        finally:
            if server is not None:
                server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({
        "model": "SmolLM2-135M-Instruct float32", "method": "reload_weights via /collective_rpc",
        "versions": len(times), "final_label": label,
        "seconds_median": round(statistics.median(times), 3),
        "seconds_min": round(min(times), 3), "seconds_max": round(max(times), 3),
        "load_avg_1m": round(os.getloadavg()[0], 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
