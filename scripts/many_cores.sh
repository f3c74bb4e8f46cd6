#!/usr/bin/env bash
# One prepared call on a lent machine with many cores (a GPU machine has 16): the CUDA tests, then `ar` at 1, 2, 4, 8
# and 16 threads on files of the real models' exact shapes with random blocks (scripts/synth_gguf.py: the real files
# cannot travel, a call takes 64 MiB), beside llama.cpp's llama-bench on the same files where its binary runs there.
# docs/benchmarks.md, "Many cores", holds what it printed.
#
#   bash scripts/many_cores.sh OUT_DIR
#
# Reads, from .dev/ (ignored by git, carried): qwen15b.head/.json and smollm2.head/.json (`synth_gguf.py header` of
# the real files), q4.jsonl (the prompts), llama-bench (the binary built here by ../shared/tools/build-llama-bench.sh),
# and .whl/ (packages the image lacks). Writes OUT_DIR/log.txt and one JSONL per model.
set -uo pipefail
out=${1:?usage: many_cores.sh OUT_DIR}
mkdir -p "$out"
log="$out/log.txt"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HOME=${HOME:-/tmp} HF_HUB_OFFLINE=1
export SELFSPEC_HOME=/tmp/selfspec-home SELFSPEC_CACHE=/tmp/selfspec-cache
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|NUMA node\(s\)|L3|Flags" | cut -c1-400
  nproc; free -g | head -2
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  git rev-parse --short HEAD 2>/dev/null; } 2>&1 | tee -a "$log"

echo "== tests/test_gpu.py" | tee -a "$log"
timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -n 15 | tee -a "$log"

echo "== the CPU kernel's build" | tee -a "$log"
s=$SECONDS
timeout 240 python3 -c "from selfspec_cli.engine import kernels; kernels.load_extension(); print(kernels.status())" 2>&1 | tail -n 5 | tee -a "$log"
echo "built in $((SECONDS - s)) s" | tee -a "$log"

ll=.dev/llama-bench
if [ -x "$ll" ] && ! "$ll" --help >/dev/null 2>&1; then echo "llama-bench does not run here" | tee -a "$log"; ll=; fi
for m in smollm2 qwen15b; do
  f=/tmp/$m-synth.gguf
  python3 scripts/synth_gguf.py fill .dev/$m $f 2>&1 | tee -a "$log"
  echo "== $m: thread_sweep" | tee -a "$log"
  s=$SECONDS
  timeout "${SWEEP_S:-200}" python3 scripts/thread_sweep.py $f .dev/q4.jsonl --threads 1,2,4,8,16 -n 64 \
    >"$out/$m-sweep.jsonl" 2>>"$log"
  echo "$m sweep exit $? after $((SECONDS - s)) s" | tee -a "$log"
  if [ -n "$ll" ]; then
    echo "== $m: llama-bench" | tee -a "$log"
    timeout 120 "$ll" -m $f -t 1,2,4,8,16 -p 64 -n 64 -r 2 -o md 2>&1 | grep -v "^llama\|^load\|^print_info" | tee -a "$log"
  fi
done
echo "done after ${SECONDS}s" | tee -a "$log"
