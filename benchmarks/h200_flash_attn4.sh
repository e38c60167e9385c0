#!/usr/bin/env bash
# FLASH_ATTN on the H200 through FlashAttention-4 (flash-attn-4, CuTe DSL): install it from carried wheels,
# run the GPU tests of FLASH_ATTN (conformance against REFERENCE, graphs, whole model against HF), then B2 and
# B1 with FLASH_ATTN and TRITON on the same machine, and the start-up time to the first token.
#
# flash-attn-4 needs nvidia-cutlass-dsl, whose CUDA 13 libraries are a 92 MB wheel: more than one device call
# may carry. Here (once): unpack that wheel, `tar -cf - . | zstd -19` it, and split the archive in two halves
# of at most 36 MB, .fa4a/cu13.part.aa and .fa4b/cu13.part.ab (both in .git/info/exclude), with
# `sha256sum cu13.tar.zst > .fa4b/sha256`. The first call carries .fa4a and runs
# `mkdir -p /tmp/fa4parts && cp .fa4a/* /tmp/fa4parts/`; the next, on the same warm machine, carries .fa4b
# and runs this script (the machine stays warm for 30 s after a call: send it at once). The other wheels go in
# .whl as usual: flash_attn_4, nvidia_cutlass_dsl, nvidia_cutlass_dsl_libs_base and _core, torch_c_dlpack_ext,
# quack_kernels (apache-tvm-ffi comes with FlashInfer's), zstandard (the machine has no zstd) and
# importlib_metadata 8.7.1 (the image lacks it; 10.x needs lazy_importer). FlashInfer's own wheel may stay behind
# to leave room. Ran on 2026-11-25 with flash-attn-4 4.0.0b36 and nvidia-cutlass-dsl 4.8.1.
#   STAGE=tests|bench|all (default all) bash benchmarks/h200_flash_attn4.sh ; logs and JSON in $OUT.
set -u
source benchmarks/h200_setup.sh || exit 1  # (re)installs /tmp/site: the CUDA libraries go in after it
cp .fa4b/* /tmp/fa4parts/ 2>/dev/null
(cd /tmp/fa4parts && cat cu13.part.* > cu13.tar.zst && sha256sum -c sha256) || { echo "cutlass-dsl parts missing"; exit 1; }
python3 -c "import sys, zstandard; zstandard.ZstdDecompressor().copy_stream(open(sys.argv[1], 'rb'), sys.stdout.buffer)" \
  /tmp/fa4parts/cu13.tar.zst | tar -xf - -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4_cache
python3 -c "
import flash_attn.cute, importlib.metadata as m
from dovetail_cuda.flash_attn_backend import variant
print('flash-attn-4', m.version('flash-attn-4'), 'cutlass-dsl', m.version('nvidia-cutlass-dsl'), 'variant', variant())
" 2>&1 | tail -3
stage=${STAGE:-all}
if [ "$stage" != bench ]; then
  log "FLASH_ATTN GPU tests"
  timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu -rs -x -k "FLASH_ATTN" tests/test_cuda_backends.py \
    tests/test_cuda_engine.py 2>&1 | tee "$OUT/fa4_tests.log" | tail -15
fi
if [ "$stage" != tests ]; then
  for kind in latency throughput; do
    for model in ${MODELS:-llama-3.1-8b}; do
      for backend in FLASH_ATTN TRITON; do
        log "$kind $model $backend"
        timeout 300 dovetail --log-level WARNING bench "$kind" --model "$model" --dtype bfloat16 \
          --attention-backend "$backend" --output-json /tmp/r.json >/dev/null 2>>"$OUT/bench.err" \
          || { echo "failed"; tail -5 "$OUT/bench.err"; continue; }
        python3 -c "
import json; r = json.load(open('/tmp/r.json'))['dovetail']
print(json.dumps({'kind': '$kind', 'model': '$model', 'backend': '$backend',
                  **{k: r[k] for k in ('output_tokens_per_s', 'ms_per_token') if k in r}}))" | tee -a "$OUT/bench.jsonl"
      done
    done
  done
  log "start-up qwen3-0.6b FLASH_ATTN (compiled kernels cached on disk by the runs above)"
  timeout 200 python3 benchmarks/cuda_startup.py --model qwen3-0.6b --attention-backend FLASH_ATTN | tee -a "$OUT/bench.jsonl"
fi
log done
