#!/usr/bin/env bash
# Every GPU check of issues 12 and 16 in one call of the device tool (one H200, ~8 min of its 15).
#
# Before the call, here (the device machine has no network; its Python has torch, grpcio,
# protobuf, numpy and msgpack, not our pure-Python extras):
#   pip download -q --no-deps -d .gpu_wheels tqdm prometheus_client grpcio-health-checking==1.78.0 \
#       pytest pluggy iniconfig pytest-timeout
# then run this with carry [".gpu_wheels"] and timeout_s ~560:
#   bash bench/gpu_checks.sh
# Results come back under $OUT (JSON + logs); record them in bench/RESULTS.md.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT"
if [ -d .gpu_wheels ]; then
  python -m pip install -q --no-index --no-deps --find-links .gpu_wheels .gpu_wheels/*.whl 2>&1 | tail -2
fi
{ nvidia-smi -L; python -c "import torch, grpc, google.protobuf as p; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'grpc', grpc.__version__, 'protobuf', p.__version__)"; } 2>&1 | tee "$OUT/env.txt"

echo "== CUDA tests (hot-row cache: pinned staging, side stream, events)"
timeout 120 python -m pytest -q -p no:cacheprovider --timeout 100 tests/integration/test_emb_cache.py -k cuda 2>&1 | tee "$OUT/pytest_cuda.log" | tail -5

echo "== issue 12: gpt through the TP and PP code paths at T=P=1 against plain torch"
timeout 100 python bench/tp_overhead.py --device cuda --precision bf16 --json-out "$OUT/tp_overhead_bf16.json" 2>&1 | tail -6
timeout 60 python bench/tp_overhead.py --device cuda --precision fp32 --json-out "$OUT/tp_overhead_fp32.json" 2>&1 | tail -6

echo "== issue 16: ctr through the PS, cache off and on, against every row on the GPU (1M rows, then 10M)"
timeout 150 python bench/gpu_worker.py --device cuda --rows 1e6 --json-out "$OUT/gpu_worker_1m.json" 2>&1 | tee "$OUT/gpu_worker_1m.log" | tail -20
timeout 120 python bench/gpu_worker.py --device cuda --rows 1e7 --e2e-steps 30 --json-out "$OUT/gpu_worker_10m.json" 2>&1 | tee "$OUT/gpu_worker_10m.log" | tail -20
echo "done"
