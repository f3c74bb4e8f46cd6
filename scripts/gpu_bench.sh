#!/usr/bin/env bash
# GPU figures (docs/benchmarks.md, "GPU"), in one prepared call on a CUDA machine.
#
#   bash scripts/gpu_bench.sh OUT_DIR [code|compiled|default]
#
# code (the default): the shipped code model (pystdlib-llama-12x256), which the repository carries:
#   1. tests/test_gpu.py: k-row forwards equal one-row steps bit for bit, and every lossless method
#      gives ar's tokens, in float32 and bfloat16, on CUDA graphs;
#   2. the bench in float32 and bfloat16: ar, HF generate, HF prompt lookup, pld, self-sd, swift, asd, auto;
#   3. ar with the CUDA graphs off (SELFSPEC_CUDA_GRAPHS=0: the eager loop) beside HF generate, to
#      show what the fixed-shape forwards change on the same machine;
#   4. HF generate with its static cache (compiled by transformers) beside ar, in a run of its own
#      (its compilation must not cost the others their time limit).
# compiled: the code model with the fixed-shape forward's sublayers compiled (SELFSPEC_COMPILE=1,
#   engine/sublayers.py): the GPU tests on compiled sublayers, then the bench in float32 and
#   bfloat16 (ar, pld, self-sd, swift, auto), and ar without compilation in the same call for the comparison.
# default: the default model (SmolLM2-135M-Instruct's GGUF, which the machine cannot download and a call
#   cannot carry whole: brought in parts by successive calls, each copying its .gpu/smollm2.gguf.part-*
#   to /tmp/gguf-parts, checked against .gpu/smollm2.gguf.sha256), converted once, then the bench in
#   bfloat16 and float32 on spec-bench-mini.
# Writes OUT_DIR/log.txt and one .tgz per bench run.
set -uo pipefail
out=${1:?usage: gpu_bench.sh OUT_DIR [code|compiled|default]}
mode=${2:-code}
mkdir -p "$out"
log="$out/log.txt"
if [ -d .whl ]; then  # packages the device's image lacks (datasets, gguf), carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HOME=${HOME:-/tmp} HF_HUB_OFFLINE=1
export SELFSPEC_HOME=${SELFSPEC_HOME:-/tmp/selfspec-home}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  git rev-parse --short HEAD 2>/dev/null; git status --short 2>/dev/null | head -20; } 2>&1 | tee -a "$log"

bench() {  # bench NAME SECONDS ARGS...: one bench run into $out/NAME.tgz, its stderr into the log
  local name=$1 limit=$2; shift 2
  local d; d=$(mktemp -d)
  echo "== $name: selfspec bench $*" | tee -a "$log"
  timeout "$limit" python3 -m selfspec_cli bench "$@" -o "$d/$name" >"$d/$name.jsonl" 2>"$d/$name.err"
  echo "$name exit $? after ${SECONDS}s" | tee -a "$log"
  grep -v '^\s*$' "$d/$name.err" | tail -n 40 >>"$log"
  mv "$d/$name.jsonl" "$d/$name.err" "$d/$name/" 2>/dev/null
  tar czf "$out/$name.tgz" -C "$d" "$name"
}

if [ "$mode" = code ]; then
  M=ar,hf,hf-pld,pld,self-sd,swift,asd,auto
  if [ -z "${NO_TESTS:-}" ]; then  # NO_TESTS=1: the benches only (a rerun after the tests passed)
    echo "== tests/test_gpu.py" | tee -a "$log"
    # (no conftest: it builds the CPU kernel, which nothing here uses)
    timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -n 30 | tee -a "$log"
  fi
  for dt in float32 bfloat16; do
    bench "code-$dt" 140 -m pystdlib --suite pystdlib-mini --device cuda --dtype $dt --methods $M --repeats ${REPEATS:-3}
  done
  SELFSPEC_CUDA_GRAPHS=0 bench code-eager 60 -m pystdlib --suite pystdlib-mini --device cuda --dtype float32 --methods ar,hf --repeats 2 --no-costs
  bench code-hf-static 100 -m pystdlib --suite pystdlib-mini --device cuda --dtype bfloat16 --methods ar,hf,hf-static --repeats 2 --no-costs
elif [ "$mode" = compiled ]; then
  export SELFSPEC_COMPILE=1
  echo "== tests, compiled" | tee -a "$log"
  timeout 240 python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_gpu.py -k "k_rows or lossless or sampling" \
    2>&1 | tail -n 30 | tee -a "$log"
  M=ar,pld,self-sd,swift,auto
  for dt in float32 bfloat16; do
    bench "code-compiled-$dt" 150 -m pystdlib --suite pystdlib-mini --device cuda --dtype $dt --methods $M --repeats ${REPEATS:-3}
  done
  SELFSPEC_COMPILE=0 bench code-graphs-float32 60 -m pystdlib --suite pystdlib-mini --device cuda --dtype float32 --methods ar --repeats 3 --no-costs
elif [ "$mode" = default ]; then
  gguf=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf  # the parts: copied to /tmp/gguf-parts by each call that brought one
  cat /tmp/gguf-parts/smollm2.gguf.part-* > "$gguf"
  if ! (cd /tmp && sha256sum -c "$OLDPWD/.gpu/smollm2.gguf.sha256") 2>&1 | tee -a "$log"; then
    ls -la /tmp/gguf-parts | tee -a "$log"; exit 1
  fi
  M=ar,hf,pld,swift,asd,auto
  bench default-bfloat16 200 -m "$gguf" --device cuda --dtype bfloat16 --methods $M --repeats 1 -n 64
  bench default-float32 150 -m "$gguf" --device cuda --dtype float32 --methods ar,pld,auto --repeats 1 -n 64 --no-costs
fi
echo "done after ${SECONDS}s" | tee -a "$log"
