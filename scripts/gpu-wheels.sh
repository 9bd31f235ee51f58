#!/usr/bin/env bash
# Run HERE (a machine with the package registry), before scripts/gpu-check.sh runs on the
# device: downloads into .whl/ (ignored by git, carried to the device) the wheels of what
# the engine needs and the device's image lacks. That image has torch, triton,
# transformers, tokenizers, safetensors, numpy and jinja2 (Python 3.12); it lacks
# llguidance (the engine's grammar masks, imported by the engine).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
version=$(python3 -c 'import importlib.metadata as m; print(m.version("llguidance"))' \
          2>/dev/null || .venv/bin/python -c 'import importlib.metadata as m; print(m.version("llguidance"))')
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_31_x86_64 -d .whl \
    "llguidance==${version}"
ls -la .whl
