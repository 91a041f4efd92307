#!/usr/bin/env bash
# The H200 sweep (run through the device tool from the repo root; $OUT collects results).
# Usage: bash bench/h200.sh tests|vit|vit-compile|preprocess|video|audio|video-serve|chat|engine|scale [extra args]
# scale: the data-parallel run (nvidia-h200-x2): 1 then 2 workers, one per GPU, the single-GPU run's mix,
#        then the bare-forward ceiling on that mix (the fleet issue's 85% target).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results}
what=$1; shift
case "$what" in
  tests) nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
         python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_vision_gpu.py tests/test_image_preprocess.py \
           tests/test_decode.py tests/test_server_gpu.py tests/test_engine_gpu.py tests/test_video_dali.py \
           "$@" 2>&1 | tail -30 ;;
  vit) python3 -m encoder_server.cli bench vit --out-dir "$OUT" --sizes 448,1008 --batches 1,4,16,32 \
         --ref-max-batch 32 "$@" ;;
  vit-compile) python3 -m encoder_server.cli bench vit --out-dir "$OUT" --name vit_compile --compile \
         --sizes 448,1008 --batches 1,4,16,32 --no-reference "$@" ;;
  preprocess) python3 -m encoder_server.cli bench preprocess --out-dir "$OUT" "$@" ;;
  video) python3 -m encoder_server.cli bench video --out-dir "$OUT" "$@" ;;
  audio) python3 -m encoder_server.cli bench audio --out-dir "$OUT" "$@" ;;
  video-serve) python3 -m encoder_server.cli bench video-serve --out-dir "$OUT" "$@" ;;
  chat) python3 -m encoder_server.cli bench chat --out-dir "$OUT" "$@" ;;
  engine) python3 -m encoder_server.cli bench engine --out-dir "$OUT" "$@" ;;
  scale) nvidia-smi --query-gpu=name,memory.total --format=csv
         for n in 1 2; do
           python3 -m encoder_server.cli bench serve --start --server-args \
             "--vision-model qwen2.5-vl-7b --dtype bfloat16 --num-workers $n --api-processes 2 --llm none" \
             --mix mixed --distinct 24 --sweep 32,96,192 --duration 12 --warmup-requests 16 --baseline none \
             --no-progress --out-dir "$OUT" --name "serve_x2_w$n" "$@"
         done
         python3 -m encoder_server.cli bench vit --out-dir "$OUT" --name vit_mix --compile --no-reference \
           --sizes 448 --batches 1 --mix mixed ;;
  *) echo "unknown: $what"; exit 2 ;;
esac
