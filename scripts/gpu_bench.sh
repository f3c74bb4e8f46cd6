#!/usr/bin/env bash
# GPU figures (docs/benchmarks.md, "On a GPU"): the code model, which the repository carries, on
# one CUDA device, fp32 and bf16, every method that runs there and the Hugging Face peers.
# Usage: bash scripts/gpu_bench.sh OUT_DIR   (writes OUT_DIR/gpu-<dtype>.tgz and the logs)
set -uo pipefail
out=${1:?usage: gpu_bench.sh OUT_DIR}
mkdir -p "$out"
if [ -d .whl ]; then  # packages the device's image lacks (datasets), carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HOME=${HOME:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, transformers, datasets, pyarrow; print('torch', torch.__version__, 'transformers', transformers.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)" | tee -a "$out/device.txt"
M=ar,hf,hf-pld,pld,self-sd,swift,asd,auto
for dt in float32 bfloat16; do
  d=$(mktemp -d)
  timeout 200 python3 -m selfspec_cli bench -m pystdlib --suite pystdlib-mini --device cuda --dtype $dt \
    --methods $M --repeats 3 -o "$d/gpu-$dt" >"$out/gpu-$dt.jsonl" 2>"$out/gpu-$dt.log"
  echo "$dt exit $?"; tail -n 25 "$out/gpu-$dt.log"
  tar czf "$out/gpu-$dt.tgz" -C "$d" "gpu-$dt"
done
