#!/usr/bin/env bash
# Measured against simulated on one GPU, for every algorithm (see docs/gpu.md). At most ~8 minutes on an H100.
#   bash benchmarks/gpu_check.sh [--out DIR]            # on cuda
#   bash benchmarks/gpu_check.sh --device cpu --tiny    # the dry run the test suite does
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
exec timeout 480 "$PYTHON" benchmarks/gpu_check.py "$@"
