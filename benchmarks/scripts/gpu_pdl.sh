#!/usr/bin/env bash
# One device call: tests/gpu, then the decode step profile (TP1 and one TP2 rank alone) with PDL off and on, twice.
# C=<commit> bash benchmarks/scripts/gpu_pdl.sh   (output under $OUT)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=$OUT/pdl.log
echo "# COMMIT=$C: tests/gpu, then FP8ROUTE_PDL=0|1 python3 benchmarks/tp_decode_profile.py --tp 1 --local-tp 2 --batch 1 ($(date -u +%FT%TZ))" > $L
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> $L
timeout 300 python3 -m pytest -q -m gpu tests/gpu -n 4 -rfEs --tb=short > $OUT/gpu_tests.log 2>&1
tail -2 $OUT/gpu_tests.log | tee -a $L; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | head -20 | tee -a $L
for p in 0 1 0 1; do echo "## FP8ROUTE_PDL=$p" >> $L; FP8ROUTE_PDL=$p timeout 100 python3 benchmarks/tp_decode_profile.py --tp 1 --local-tp 2 --batch 1 2>&1 | grep -v -i warn >> $L; done
grep -E "^## |^tp=|FAILED|passed|failed" $L
