#!/usr/bin/env bash
# Regenerates the consistency experiments shown in bench/RESULTS.md (about 15-25 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/../.."
common=(--task ctr --workers 4 --shards 2 --modes sync,async,ssp:1,ssp:4,ssp:16 --steps 400 --batch-size 128 --eval-every 25 --seed 0)
tessera experiment consistency "${common[@]}" --straggler 1x4 --out bench/experiments/straggler
tessera experiment consistency "${common[@]}" --out bench/experiments/no-straggler
