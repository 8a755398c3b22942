#!/usr/bin/env bash
# Regenerate sample_graphs/*.pt from the example scripts (CPU is enough: the
# analytic cost model estimates H100 times without running the nodes).
#
#   bash examples/make_sample_graphs.sh            # uses `dcsched` on PATH
#   DCSCHED=".venv/bin/dcsched" bash examples/make_sample_graphs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DCSCHED="${DCSCHED:-dcsched}"
COMMON=(--cost-model analytic --gpu h100 --world-size 8 --bandwidth 100 --latency 20 --force --no-progress)
mkdir -p sample_graphs
$DCSCHED profile examples/gpt.py -o sample_graphs/gpt.pt "${COMMON[@]}" -- \
    --layers 4 --d-model 512 --heads 8 --vocab 4096 --seq 256 --batch 8
$DCSCHED profile examples/llama.py -o sample_graphs/llama.pt "${COMMON[@]}" -- \
    --layers 4 --d-model 512 --heads 8 --vocab 4096 --seq 256 --batch 8
$DCSCHED profile examples/convnet.py -o sample_graphs/convnet.pt "${COMMON[@]}" -- \
    --layers 4 --width 64 --image 64 --batch 32
ls -l sample_graphs/*.pt
