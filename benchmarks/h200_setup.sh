#!/usr/bin/env bash
# Install Dovetail on the H200 test machine (see ../shared/gpu/README.md): the carried wheels of .whl/,
# then the repository's distributions, editable. Source it: `source benchmarks/h200_setup.sh`.
# A FlashInfer JIT cache carried as .fi_cache/flashinfer.tgz (from an earlier run) is unpacked too.
# Also what every H200 script starts with: $OUT (default /tmp/out) made, and `log` for timed headings.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log() { echo "== $* (t=${SECONDS}s)"; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . -e plugins/cpu -e plugins/cuda \
  -e plugins/models >/tmp/pip-editable.log 2>&1 || { tail -20 /tmp/pip-editable.log; return 1; }
if [ -f .fi_cache/flashinfer.tgz ]; then
  mkdir -p ~/.cache && tar xzf .fi_cache/flashinfer.tgz -C ~/.cache && echo "FlashInfer JIT cache unpacked"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, flashinfer, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'flashinfer', flashinfer.__version__, 'transformers', transformers.__version__)"
git log -1 --format='commit %h %s' 2>/dev/null || true
