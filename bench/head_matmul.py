"""The output head's matmul on this CPU, float32: ``F.linear`` (what transformers runs) against
oneDNN on a packed copy of the weight (what the ``hf`` backend's decode loop runs,
``streamrl.policy.hf.head``), at SmolLM2-135M's head (49,152 x 576) and a layer's (576 x 1,536),
for 64, 32 and 8 rows. Interleaved rounds, so that a noisy machine shows as spread.

    python bench/head_matmul.py [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch


def _gflops(fn, flops: int, n: int = 30) -> float:
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return round(flops * n / (time.perf_counter() - t) / 1e9, 1)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch._C._nn.mkldnn_linear(x.to_mkldnn(), packed, bias).to_dense()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, (k, n) in {"head": (576, 49152), "mlp up": (576, 1536)}.items():
        w = torch.randn(n, k)
        packed, bias = w.to_mkldnn(), torch.zeros(n).to_mkldnn()
        for m in (64, 32, 8):
            x = torch.randn(m, k)
            flops = 2 * m * k * n
            linear, onednn = [], []
            plain = functools.partial(torch.nn.functional.linear, x, w)
            ours = functools.partial(_onednn, x, packed, bias)
            for _ in range(args.rounds):
                linear.append(_gflops(plain, flops))
                onednn.append(_gflops(ours, flops))
            rows.append({"matrix": name, "shape": [n, k], "rows": m,
                         "linear_gflops": linear, "onednn_packed_gflops": onednn})  # fmt: skip
    result = {"threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "rows": rows}
    if not args.json:
        for r in rows:
            print(f"{r['matrix']:<7} {r['rows']:>3} rows: F.linear {r['linear_gflops']} "
                  f"GFLOP/s, oneDNN packed {r['onednn_packed_gflops']}")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
