#!/usr/bin/env bash
# The prepared device check (docs/bench.md "On a GPU"): at most 8 minutes on one H200.
#
#   here:        bash scripts/gpu-wheels.sh          (once: .whl/ with what the image lacks)
#   the device:  bash scripts/gpu-check.sh           (with .whl carried; OUT set by the tool)
#
# Writes $OUT/gpu-check.json (parity against transformers in bf16 on a ~0.44B random Llama
# written locally, host syncs per decode step, the decode step against the HBM roofline at
# batch 1/8/32/128 with and without CUDA graphs, python -m backend.bench on cuda against
# transformers generate) and $OUT/bench.json, $OUT/gpu-check.log, $OUT/nvidia-smi.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
# 450 s for the check, the rest of the 8 minutes for the start and the wheels
timeout 450 python3 -m backend.bench.gpu_check --out "$OUT" --bench-timeout 200 "$@" \
    2>&1 | tee "$OUT/gpu-check.log"
status=${PIPESTATUS[0]}
echo "gpu-check exit status: $status"
exit "$status"
