#!/usr/bin/env bash
# The H200 sweep (run through the device tool from the repo root; $OUT collects results).
# Usage: bash bench/h200.sh tests|vit|vit-compile|preprocess|video|audio|video-serve|chat|engine [extra args]
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
  *) echo "unknown: $what"; exit 2 ;;
esac
