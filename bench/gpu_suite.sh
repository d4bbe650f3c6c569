#!/usr/bin/env bash
# One device call: build a random 0.6B folder, time our engine (breakdown + scheduler throughput),
# with the peer faster-qwen3-tts timed first on the same folder, so every figure has a peer's beside it
# (the peer runs first: a call cut short still has it).
# Run from the repo root on the GPU machine (see bench/README.md for the wheels it needs in .whl/).
#   STAGES=model,breakdown,first_audio,throughput,ttfa,peer bash bench/gpu_suite.sh
# Every stage appends its rows to $OUT/results.jsonl as it finishes; the logs come back as logs.tgz.
set -u
OUTD=${OUT:-/tmp/bench_out}; mkdir -p "$OUTD"
STAGES=${STAGES:-model,breakdown,throughput,peer}
MODEL=${MODEL:-/tmp/rand06b}
R="$OUTD/results.jsonl"
# DEADLINE: seconds after which no further stage starts (a device call's time is counted).
has() { [[ ",$STAGES," == *",$1,"* ]] && { (( SECONDS - t0 < ${DEADLINE:-100000} )) || { echo "$1 skipped: past DEADLINE"; false; }; }; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
t0=$SECONDS
# Server-side packages the GPU image lacks (starlette, uvicorn, websockets, soundfile, soxr).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_srv .whl/srv/*.whl \
  .whl/common/soundfile-*.whl .whl/common/soxr-*.whl .whl/common/cffi-*.whl .whl/common/pycparser-*.whl 2>&1 | grep -vi warning
export PYTHONPATH=/tmp/site_srv:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUTD/env.txt" 2>&1
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' >> "$OUTD/env.txt" 2>&1
if has model; then
  python3 -m engine.testing.random_model --preset 0.6b --seed 0 --out "$MODEL" --bf16 > "$OUTD/model.log" 2>&1
  echo "model rc=$? at $((SECONDS-t0)) s"
fi
if has peer; then
  OUT="$OUTD" PB_MODEL="$MODEL" PB_FRAMES=${FRAMES:-125} PB_FQ_MODES=${PB_FQ_MODES:-single} PB_FQ_CHUNKS=2 \
    PB_FQ_TIMEOUT=200 PB_QT_BATCHES=${PB_QT_BATCHES:-1,64} PB_QT_REPS=${PB_QT_REPS:-1} PB_QT_TIMEOUT=150 \
    bash .peers/run_all.sh ${PEER_STAGES:-fq517} > "$OUTD/peer.log" 2>&1
  echo "peer rc=$? at $((SECONDS-t0)) s"
fi
# throughput right after the peer: the figures to set beside its own, before a DEADLINE cuts the call
# VOCODER_BATCHES: the scheduler's vocoder_batch values to measure (most streams a vocoder replay decodes)
# WINDOWS: vocoder window sizes to measure ("first,later" frames, bench.throughput --window), each tagged
# REPS: runs of each batch size (bench.throughput --reps)
# SUSTAINED: then that many turns through the largest batch's slots (bench.throughput --sustained)
# TREES: source trees to time one after the other on this machine (an A/B of commits; each tagged
#   with its path): "." is the working tree, others hold a commit's engine/ and bench/, made on the
#   host by `git archive REV engine bench | tar -x -C .device/REV` and carried along
# VARIANTS: environment settings to time in turn, space-separated (e.g. "QWEN3_TTS_PDL=1 QWEN3_TTS_PDL=0";
#   "-": none; "A=1,B=2": two at once), each tagged with its setting (a process each)
# DEFER_AUDIO: Scheduler.defer_audio values to time in one process, comma-separated (bench.throughput
#   --defer-audio: one warm-up for all, each row with its value)
if has throughput; then
  for tree in ${TREES:-.}; do
    for variant in ${VARIANTS:--}; do
      [[ $variant == - ]] && variant= tag=$tree || tag="$tree $variant"
      for vb in ${VOCODER_BATCHES:-64}; do
        for win in ${WINDOWS:-2,8}; do
          (cd "$tree" && env ${variant//,/ } PYTHONPATH=/tmp/site_srv:$PWD timeout 300 python3 -m bench.throughput \
            --model-dir "$MODEL" --batches ${BATCHES:-1,64,256} --frames ${FRAMES:-125} --reps ${REPS:-1} \
            --vocoder-batch $vb --window $win ${SUSTAINED:+--sustained $SUSTAINED} ${DEFER_AUDIO:+--defer-audio $DEFER_AUDIO} --tag "$tag${WINDOWS:+ window $win}" --out "$R") >> "$OUTD/throughput.log" 2>&1
          echo "throughput ($tag, vocoder batch $vb, window $win) rc=$? at $((SECONDS-t0)) s"
        done
      done
    done
  done
fi
# the scheduler's iteration in variants under a steady load, one process (VARIANT_NAMES: which, comma-separated)
if has variants; then
  timeout ${VARIANT_TIMEOUT:-420} python3 -m bench.sustained_variants --model-dir "$MODEL" --slots ${VARIANT_SLOTS:-256} \
    --turns ${VARIANT_TURNS:-640} ${VARIANT_NAMES:+--variants $VARIANT_NAMES} --out "$R" > "$OUTD/variants.log" 2>&1
  echo "sustained variants rc=$? at $((SECONDS-t0)) s"
fi
# the GPU's busy and idle time a step, stream by stream, in the middle of a steady load
if has timeline; then
  timeout 300 python3 -m bench.steady_timeline --model-dir "$MODEL" --slots ${TIMELINE_SLOTS:-256} \
    --turns ${TIMELINE_TURNS:-1024} --out "$R" > "$OUTD/timeline.log" 2>&1
  echo "steady timeline rc=$? at $((SECONDS-t0)) s"
fi
if has checks; then
  timeout 200 python3 -m bench.gpu_checks --model-dir "$MODEL" ${CHECKS:+--only $CHECKS} --out "$R" > "$OUTD/checks.log" 2>&1
  echo "checks rc=$? at $((SECONDS-t0)) s"
fi
# MEMORY_VARIANTS: environment settings to measure the memory under in turn, as VARIANTS (each row tagged)
if has memory; then
  for variant in ${MEMORY_VARIANTS:--}; do
    [[ $variant == - ]] && variant=
    for vb in ${VOCODER_BATCHES:-64}; do
      env ${variant//,/ } timeout 200 python3 -m bench.memory --model-dir "$MODEL" --vocoder-batch $vb --tag "$variant" --out "$R" \
        >> "$OUTD/memory.log" 2>&1
      echo "memory (vocoder batch $vb, setting '$variant') rc=$? at $((SECONDS-t0)) s"
    done
  done
fi
if has breakdown; then
  timeout 240 python3 -m bench.breakdown --model-dir "$MODEL" --batches ${BATCHES_BREAKDOWN:-1,64,256} --out "$R" > "$OUTD/breakdown.log" 2>&1
  echo "breakdown rc=$? at $((SECONDS-t0)) s"
fi
if has first_audio; then
  # 240 s: on a fresh machine this can be the first process to compile the Triton kernels (~100 s)
  timeout 240 python3 -m bench.first_audio --model-dir "$MODEL" --out "$R" > "$OUTD/first_audio.log" 2>&1
  echo "first_audio rc=$? at $((SECONDS-t0)) s"
  # a burst of BURST sessions at once (0: none): where the admission time goes at load
  if (( ${BURST:-256} > 0 )); then
    for budget in ${BURST_BUDGETS:-4096}; do     # the scheduler's prefill budget (positions an iteration)
      timeout 180 python3 -m bench.first_audio --model-dir "$MODEL" --sessions ${BURST:-256} --reps 2 \
        --prefill-budget $budget ${BURST_PROFILE:+--profile} --out "$R" >> "$OUTD/first_audio.log" 2>&1
      echo "first_audio burst (prefill budget $budget) rc=$? at $((SECONDS-t0)) s"
    done
  fi
fi
if has ttfa; then
  timeout 300 bash bench/ttfa_device.sh "$MODEL" "$R" > "$OUTD/ttfa.log" 2>&1
  echo "ttfa rc=$? at $((SECONDS-t0)) s"
fi
if has precision; then
  timeout 200 python3 -m bench.precision --model-dir "$MODEL" --out "$R" > "$OUTD/precision.log" 2>&1
  echo "precision rc=$? at $((SECONDS-t0)) s"
fi
# kernel probes that need no model: cuDNN's conv layouts at each window size, with its timing (1) and
# its heuristics (0); the attention kernel's launch configs timed in CUDA graphs
if has conv; then
  for frames in ${CONV_FRAMES:-8 2}; do
    for bm in 1 0; do
      timeout 120 python3 -m bench.conv_layout --batch ${CONV_BATCH:-32} --frames $frames --benchmark $bm --out "$R" \
        >> "$OUTD/conv.log" 2>&1
      echo "conv layout ($frames frames, benchmark $bm) rc=$? at $((SECONDS-t0)) s"
    done
  done
fi
# the vocoder's SnakeBeta and residual-tail kernels in each launch config, either layout
if has tiles; then
  # EXTRA_TAIL: more residual-tail configs to time (bench.vocoder_tiles --extra-tail)
  timeout 240 python3 -m bench.vocoder_tiles --batch ${CONV_BATCH:-32} ${EXTRA_TAIL:+--extra-tail $EXTRA_TAIL} \
    --out "$R" > "$OUTD/tiles.log" 2>&1
  echo "vocoder tiles rc=$? at $((SECONDS-t0)) s"
fi
# the skinny GEMMs (1-16 rows) in every config, alone and chained, timed in CUDA graphs
if has skinny; then
  timeout 400 python3 -m bench.skinny_gemms --rows ${SKINNY_ROWS:-1,8} ${SKINNY_EXTRA:+--extra $SKINNY_EXTRA} \
    --out "$R" > "$OUTD/skinny.log" 2>&1
  echo "skinny gemms rc=$? at $((SECONDS-t0)) s"
fi
# the sampling kernel in each config, 1 to 256 rows (SAMPLE_ROWS), timed in CUDA graphs
if has sample; then
  timeout 200 python3 -m bench.sample_kernel --rows ${SAMPLE_ROWS:-1,16,256} --out "$R" > "$OUTD/sample.log" 2>&1
  echo "sample kernel rc=$? at $((SECONDS-t0)) s"
fi
if has attention; then
  timeout 300 python3 -m bench.attention_configs --out "$R" > "$OUTD/attention.log" 2>&1
  echo "attention configs rc=$? at $((SECONDS-t0)) s"
fi
if has profile; then
  timeout 150 python3 -m bench.profile_step --model-dir "$MODEL" --batch ${PROFILE_BATCH:-256} > "$OUTD/profile.log" 2>&1
  echo "profile rc=$? at $((SECONDS-t0)) s"
fi
grep -h '"kind": "error"' "$R" 2>/dev/null | cut -c1-400
python3 .peers/report.py "$R" 2>/dev/null
python3 -m bench.ratios "$R"
grep -h RESULT "$OUTD"/*.log | cut -c1-600
echo "total $((SECONDS-t0)) s"
# At most 8 files come back from a device call: keep results.jsonl, pack the logs into one.
tar czf /tmp/logs.tgz -C "$OUTD" --exclude=results.jsonl . 2>/dev/null && \
  find "$OUTD" -mindepth 1 ! -name results.jsonl -delete && mv /tmp/logs.tgz "$OUTD/"
