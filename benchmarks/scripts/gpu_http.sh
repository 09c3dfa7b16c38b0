#!/usr/bin/env bash
# `fp8route serve` on one H200 (issue 27), driven over real HTTP by `fp8route bench serve --url`, in
# one device call; output under $OUT: gpu.txt, the summary, and results.tgz, every log and JSON.
# PHASES lists what to run, in order:
#   tests:    the GPU tests TESTS names
#   prefill:  the seed's prefill-heavy load against a routed, a cuBLASLt-only and a rowwise-only server
#   decode:   the decode-heavy load on the offline engine (bench serve) and over HTTP (a routed server)
#   overload: OVERLOAD_S seconds of Poisson arrivals at RATE requests/s (1.5x the capacity the decode
#             phase measured) with --max-queue QUEUE and a DISCONNECT share of clients leaving
#             mid-stream; the server's RSS and the GPU's memory sampled every 10 s
# The serve wheels the device lacks travel in .whl/ (carry it). CKPT and SMALL=1 (tiny loads) let
# the script be tried on a CPU with smollm2 first (SKIP_WHEELS=1 where the serve extra is installed).
set -u -o pipefail
if [ -d .whl ] && [ -z "${SKIP_WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
work=/tmp/gpu-http; rm -rf "$work"; mkdir -p "$work"  # all of it comes back in results.tgz
log="$OUT/gpu.txt"
echo "# PHASES='$PHASES' COMMIT=${COMMIT:-unknown} RATE=${RATE:-} bash benchmarks/scripts/gpu_http.sh ($(date -u +%FT%TZ))" | tee "$log"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null | tee -a "$log"
python3 -c "import torch, triton, fastapi, uvicorn; print('torch', torch.__version__, 'triton', triton.__version__, 'fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__)" | tee -a "$log"
ckpt=${CKPT:-/tmp/ckpt-8b}
if [ "$ckpt" = /tmp/ckpt-8b ] && [ ! -f $ckpt/config.json ]; then
    python3 -c "
from pathlib import Path
from fp8route.checkpoint.random import write_random
from fp8route.models.shapes import MODELS
write_random(Path('$ckpt'), MODELS['llama-3.1-8b'], fp8=True)" 2>&1 | tail -1
fi
if [ ! -f $ckpt/tokenizer.json ] && [ -f $ckpt/config.json ]; then
    # A random checkpoint has no tokenizer, and the server detokenizes what it streams: a word-level one
    # over the model's vocabulary (token i is "w<i>") stands in. The load sends token ids either way.
    python3 -c "
import json
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
vocab = json.load(open('$ckpt/config.json'))['vocab_size']
tok = Tokenizer(models.WordLevel({f'w{i}': i for i in range(vocab)}, unk_token='w0'))
tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(prefix='##')
tok.save('$ckpt/tokenizer.json')
print(f'tokenizer.json: a word-level stand-in over {vocab} ids')"
fi
if [ "${SMALL:-0}" = 1 ]; then
    prefill_load=(--num-prompts 16 --input-len 64:256 --output-len 4:8)
    decode_load=(--num-prompts 24 --input-len 32:64 --output-len 8:16)
else
    prefill_load=(--num-prompts 512 --input-len 1024:4096 --output-len 16:64)
    decode_load=(--num-prompts 1024 --input-len 512:1536 --output-len 128:512)
fi
url=http://127.0.0.1:8000
pack() { tar -czf "$OUT/results.tgz" -C "$work" . ; }

start_server() {  # name, then serve's options; sets $server
    local name=$1; shift
    python3 -m fp8route serve "$ckpt" --port 8000 --max-model-len 8192 "$@" > "$work/$name.server.log" 2>&1 &
    server=$!
    local t0=$SECONDS
    until python3 -c "import urllib.request; urllib.request.urlopen('$url/health', timeout=2)" 2>/dev/null; do
        if ! kill -0 $server 2>/dev/null || [ $((SECONDS - t0)) -gt 300 ]; then
            echo "== $name: the server did not come up" | tee -a "$log"; tail -5 "$work/$name.server.log" | tee -a "$log"
            kill -9 $server 2>/dev/null; return 1
        fi
        sleep 1
    done
    echo "== $name: up in $((SECONDS - t0)) s: $(grep -m1 'KV pool' "$work/$name.server.log")" | tee -a "$log"
}

stop_server() {  # name: SIGTERM, which drains; records the exit code
    local name=$1
    kill -TERM $server; wait $server
    echo "== $name: server exit code $? after SIGTERM" | tee -a "$log"
}

bench() {  # name, then bench serve's options
    local name=$1; shift
    timeout "${BENCH_TIMEOUT:-400}" python3 -m fp8route bench serve "$ckpt" --out "$work/$name" "$@" > "$work/$name.log" 2>&1
    echo "== $name (rc $?): bench serve $*" | tee -a "$log"
    sed -n '/^arm /,/^$/p' "$work/$name.log" | tee -a "$log"
    grep -E "requests: |KV pool|server memory" "$work/$name.log" | sort -u | tee -a "$log"
}

for phase in $PHASES; do
    case $phase in
    tests)  # TESTS: which GPU tests (pytest paths)
        # shellcheck disable=SC2086
        timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q ${TESTS:?TESTS: pytest paths} -rfEs --tb=short > "$work/gpu_tests.log" 2>&1
        tail -3 "$work/gpu_tests.log" | tee -a "$log"; grep -E "^(FAILED|ERROR)" "$work/gpu_tests.log" | head -20 | tee -a "$log"
        pack ;;
    prefill)
        for policy in routed cublas rowwise; do
            start_server "prefill-$policy" --policy $policy || continue
            bench "prefill-http-$policy" --url $url "${prefill_load[@]}"
            stop_server "prefill-$policy"; pack
        done ;;
    decode)
        bench decode-offline --policy routed --max-model-len 8192 "${decode_load[@]}"; pack
        start_server decode-routed --policy routed || continue
        bench decode-http --url $url "${decode_load[@]}"
        stop_server decode-routed; pack ;;
    overload)
        rate=${RATE:?RATE: requests/s, 1.5x the decode phase capacity}
        n=$(python3 -c "print(int($rate * ${OVERLOAD_S:-300}))")
        start_server overload --policy routed --max-queue "${QUEUE:-256}" || continue
        (
            echo "seconds,server_rss_mib,engine_rss_mib,gpu_used_mib,running,waiting"
            while kill -0 $server 2>/dev/null; do
                python3 - "$url" "$SECONDS" <<'EOF'
import subprocess, sys, urllib.request
text = urllib.request.urlopen(sys.argv[1] + "/metrics", timeout=5).read().decode()
m = {l.rpartition(" ")[0]: float(l.rpartition(" ")[2]) for l in text.splitlines() if l and not l.startswith("#")}
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout.strip()
except FileNotFoundError:
    gpu = "nan"
engine = m.get("fp8route:engine_resident_memory_bytes", float("nan")) / 2**20
print(f"{sys.argv[2]},{m['process_resident_memory_bytes'] / 2**20:.0f},{engine:.0f},{gpu},{m['fp8route:num_requests_running']:.0f},{m['fp8route:num_requests_waiting']:.0f}")
EOF
                sleep 10
            done
        ) > "$work/overload_memory.csv" 2>/dev/null &
        sampler=$!
        bench overload-http --url $url "${decode_load[@]:2}" --num-prompts "$n" --request-rate "$rate" \
            --disconnect-fraction "${DISCONNECT:-0.2}" --seed 7
        grep -c "" "$work/overload_memory.csv" | sed 's/^/memory samples (+ header): /' | tee -a "$log"
        sed -n '2p;$p' "$work/overload_memory.csv" | sed 's/^/memory first, last: /' | tee -a "$log"
        stop_server overload; kill $sampler 2>/dev/null; pack ;;
    esac
done
pack
