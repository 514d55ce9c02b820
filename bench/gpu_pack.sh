#!/usr/bin/env bash
# Packs what bench/gpu_run.sh needs on a GPU machine without network, from this checkout's
# .venv (the versions it holds) and this machine's redis-server:
#   .whl/  Python 3.12 wheels of streamrl's dependencies that a CUDA PyTorch image lacks
#   .gpu/  redis-server with the libraries it links (bin/redis-server sets LD_LIBRARY_PATH for
#          it alone) and .gpu/smollm2/, SmolLM2-135M's config and tokenizer (no weights)
# Both are in .gitignore; together about 50 MB.
set -eu
PY=${PY:-.venv/bin/python}
version() { "$PY" -m pip show "$1" 2>/dev/null | awk '/^Version/{print $2}'; }
pkgs=""
for p in transformers huggingface_hub tokenizers trl datasets dill multiprocess peft redis \
    hiredis rq msgspec structlog setproctitle tenacity jsonschema jsonschema-specifications \
    referencing rpds-py jsonschema-rs tomli_w httpx2 httpcore2 truststore croniter click regex \
    hf-xet fsspec h11 psutil rich markdown-it-py mdurl pygments prometheus-client safetensors \
    pytest-xdist execnet; do
    v=$(version "$p")
    [ -n "$v" ] && pkgs="$pkgs $p==$v"
done
mkdir -p .whl
plats=""
for n in 17 24 27 28 31 34 35; do plats="$plats --platform manylinux_2_${n}_x86_64"; done
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux1_x86_64 $plats \
    -d .whl $pkgs
mkdir -p .gpu/bin .gpu/lib .gpu/libexec .gpu/smollm2
exe=$(readlink -f "$(command -v redis-server)")
cp "$exe" .gpu/libexec/redis-server  # the name, not the link's target, sets its mode
ldd "$exe" | awk '/=> \//{print $3}' | while read -r lib; do
    case $(basename "$lib") in libc.so*|libm.so*|libstdc++*|libgcc_s*) ;; *) cp -L "$lib" .gpu/lib/ ;; esac
done
cat > .gpu/bin/redis-server <<'EOF'
#!/bin/sh
d=$(cd "$(dirname "$0")/.." && pwd)
LD_LIBRARY_PATH="$d/lib" exec "$d/libexec/redis-server" "$@"
EOF
chmod +x .gpu/bin/redis-server
for f in models/smollm2-135m/*; do
    case $f in *.safetensors) ;; *) cp "$f" .gpu/smollm2/ ;; esac
done
du -sh .whl .gpu
