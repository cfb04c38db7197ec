#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py), for a session lent a GPU machine by the device tool; about 6 minutes.
#
# The device image has torch, transformers, accelerate and safetensors but not Hydra: carry its wheels. Once, here:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform any -d .whl hydra-core==1.3.2 omegaconf==2.3.0
#   python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3   # published as a source archive only
# (380 KB in all).
# then run it there:   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=420)
# It writes $OUT/gpu_check.json (every figure) and $OUT/gpu_check.log.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu_check.log"
PYTHONUNBUFFERED=1 timeout 360 python3 scripts/gpu_check.py --out "$OUT/gpu_check.json" 2>&1 | tee -a "$OUT/gpu_check.log"
