"""SmolLM2-135M's matmuls on this CPU, float32: ``F.linear`` (what transformers runs, MKL's
sgemm), oneDNN on a plain packed copy of the weight (``to_mkldnn``, what the ``hf`` backend's
decode loop ran for its output head until 2026-11-27) and oneDNN on the weight reordered to its
own blocked layout (``_reorder_linear_weight``: what the loop runs now for every large layer,
``streamrl.policy.hf.packed``), at the head (49,152 x 576) and a layer's shapes, for a
prefill's 2,880 rows and a decode step's 64 and 8. Interleaved rounds, so that a noisy machine
shows as spread.

    python bench/packed_matmul.py [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch

from streamrl.policy.hf.packed import ROWS_HINT

SHAPES = {"head": (576, 49152), "q/o": (576, 576), "gate/up": (576, 1536), "down": (1536, 576)}


def _gflops(fn, flops: int, seconds: float = 0.3) -> float:
    fn()
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        fn()
        n += 1
    return round(flops * n / (time.perf_counter() - t) / 1e9, 1)


def _plain(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch._C._nn.mkldnn_linear(x.to_mkldnn(), packed, bias).to_dense()


def _blocked(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        for name, (k, n) in SHAPES.items():
            w = torch.randn(n, k) * 0.02
            plain, bias = w.to_mkldnn(), torch.zeros(n).to_mkldnn()
            blocked = torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT)
            for m in (2880, 64, 8):
                x = torch.randn(m, k)
                flops = 2 * m * k * n
                fns = {
                    "linear": functools.partial(torch.nn.functional.linear, x, w),
                    "onednn_plain": functools.partial(_plain, x, plain, bias),
                    "onednn_blocked": functools.partial(_blocked, x, blocked),
                }
                rates: dict[str, list[float]] = {f: [] for f in fns}
                for _ in range(args.rounds):
                    for f, fn in fns.items():
                        rates[f].append(_gflops(fn, flops))
                rows.append({"matrix": name, "shape": [n, k], "rows": m,
                             **{f"{f}_gflops": r for f, r in rates.items()}})  # fmt: skip
    result = {"threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
              "torch": torch.__version__, "rows": rows}  # fmt: skip
    if not args.json:
        for r in rows:
            print(f"{r['matrix']:<8} {r['rows']:>5} rows: F.linear {r['linear_gflops']}, "
                  f"oneDNN plain {r['onednn_plain_gflops']}, "
                  f"oneDNN blocked {r['onednn_blocked_gflops']} GFLOP/s")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
