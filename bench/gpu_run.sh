#!/usr/bin/env bash
# The GPU checks, as run on a lent GPU machine (no network there): the learner's and the hf
# backend's tests on CUDA, then asynchronous against synchronous training on the GPU.
#
# What travels with the working tree (made on a machine with PyPI, see docs/gpu.md):
#   .whl/  the Python 3.12 wheels streamrl needs beyond the machine's image
#   .gpu/  a redis-server binary with its libraries (bin/redis-server wraps it) and
#          .gpu/smollm2/, SmolLM2-135M's config and tokenizer (no weights: too large)
# Results go to $OUT (or ./gpu-out).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
TEST_S=${TEST_S:-200}
BENCH_S=${BENCH_S:-75}
WORKERS=${WORKERS:-4}
STALENESS=${STALENESS:-1,0}
TESTS=${TESTS:-tests/learner/test_loop.py tests/learner/test_restart.py tests/learner/test_trl_parity.py
tests/learner/test_mismatch.py tests/learner/test_losses.py tests/policy/test_hf.py}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=$PWD/.gpu/bin:$PATH PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'trl', trl.__version__, torch.cuda.get_device_name(0))" || exit 1
redis-server --version

# 1. the learner (device = "auto": CUDA here) and the hf backend (STREAMRL_TEST_DEVICE) tests
STREAMRL_TEST_DEVICE=cuda timeout "$TEST_S" python3 -m pytest -q -p no:cacheprovider -n 8 \
    -o addopts="" $TESTS -rfE 2>&1 | tee "$OUT/tests.log" | tail -40

# 2. asynchronous (max_staleness 1) against synchronous (0), SmolLM2-135M's body, random weights
timeout $((4 * BENCH_S + 200)) python3 bench/async_sync.py --random-like .gpu/smollm2 \
    --vocab tiny --seconds "$BENCH_S" --rollout-workers "$WORKERS" --max-new-tokens 64 \
    --staleness "$STALENESS" --out "$OUT/async_sync.json" --keep 2>&1 | grep -v '^{"step' | tail -20
for d in /tmp/srl-async-sync-*/staleness*; do
    tail -c 4000 "$d/logs/learn.log" > "$OUT/learn_$(basename "$d").log" 2>/dev/null
    tail -c 3000 "$d/logs/rollout0.log" > "$OUT/rollout0_$(basename "$d").log" 2>/dev/null
done
