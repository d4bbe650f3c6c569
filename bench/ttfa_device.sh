#!/usr/bin/env bash
# Through the server: start qwen3-tts-server on a model folder, wait for /ready, then bench/ttfa.py
# with one session and with many real-time sessions (10 s fixed-length turns).
#   bash bench/ttfa_device.sh MODEL_DIR RESULTS_JSONL
set -u
MODEL=$1; R=$2; PORT=${PORT:-8090}
# SLOW_ITERATION_MS (server default 250): log every engine iteration longer than this, with its phases
python3 -m app --model-dir "$MODEL" --port $PORT --max-batch ${MAX_BATCH:-256} > "${OUT:-/tmp}/server.log" 2>&1 &
SERVER=$!
for i in $(seq 1 240); do
  python3 -c "import urllib.request; urllib.request.urlopen(\"http://127.0.0.1:$PORT/ready\", timeout=2)" 2>/dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "server exited"; tail -30 "${OUT:-/tmp}/server.log"; exit 1; }
  sleep 1
done
echo "ready after ${i} s"
gpu_used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null; }
echo "GPU memory used, idle server after warm-up: $(gpu_used)"
python3 -c "import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:$PORT/health\").read().decode())"
for spec in ${TTFA_RUNS:-"1:0" "64:32" "256:64"}; do
  n=${spec%%:*}; rate=${spec##*:}
  python3 bench/ttfa.py --url "http://127.0.0.1:$PORT" --sessions $n --rate $rate --text-chars 160 \
    --max-frames 125 --fixed-length --timeout 300 --json "${OUT:-/tmp}/ttfa_$n.json" | tail -8
  # the server's histograms so far (iteration time, batch size, event-loop lag, TTFA), cumulative
  python3 -c "import urllib.request; print(urllib.request.urlopen(\"http://127.0.0.1:$PORT/metrics\").read().decode())" \
    | grep -E "^qwen3_tts_(step_seconds|batch_size|event_loop_lag|ttfa_seconds|underruns)" > "${OUT:-/tmp}/metrics_after_$n.txt"
done
sleep 2; echo "GPU memory used, idle server after the runs: $(gpu_used)"
kill -TERM $SERVER; wait $SERVER 2>/dev/null
grep -iE "warm|graph|error" "${OUT:-/tmp}/server.log" | head -20
echo "slow engine iterations: $(grep -c "slow engine iteration" "${OUT:-/tmp}/server.log")"
grep "ran dry" "${OUT:-/tmp}/server.log" | head -20
