#!/usr/bin/env bash
# Rebuild every committed artifact of a model: Self-SD's calibrated skip set, AdaDecode's
# heads, SpecEE's exit predictors and schedule, written where `selfspec generate` looks
# for shipped artifacts (artifacts/<kind>/<model name>; override with OUT=dir).
#
#   scripts/rebuild_artifacts.sh                     # the default model, SmolLM2-135M-Instruct
#   scripts/rebuild_artifacts.sh pystdlib examples/calibration.jsonl
#   scripts/rebuild_artifacts.sh path/to/model.gguf my-prompts.jsonl
#
# Each artifact carries the model fingerprint, so old ones are refused after the weights
# change. Order matters: SpecEE's predictors draft with the shallowest AdaDecode head, and
# its schedule needs the predictors. Each step prints its wall time on stderr.
# Calibration prompts must not overlap the benchmark suites (the default file,
# examples/chat-calibration.jsonl, shares no question with Spec-Bench: tests/test_chat_calibration.py).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-smollm2}
CAL=${2:-examples/chat-calibration.jsonl}
OUT=${OUT:-artifacts}
TOKENS=${TOKENS:-128}      # on-policy tokens per prompt for the early-exit data
TRIALS=${TRIALS:-40}       # Self-SD search trials
NAME=$(python -c "import sys; from selfspec_cli import artifacts, loading; print(artifacts.sanitized_model_name(loading.resolve_model_path(sys.argv[1])))" "$MODEL")
echo "model $MODEL -> artifacts named $NAME under $OUT/" >&2

# The shipped tree is read-only data by default (user artifacts go to $SELFSPEC_HOME):
# this script writes it on purpose, with explicit --output paths and --force.
# the Optuna study belongs to the old weights: start a fresh one
rm -f "$OUT/self-sd/$NAME.optuna.db"
time selfspec calibrate --method self-sd -m "$MODEL" --prompt-file "$CAL" --num-prompts 8 --trials "$TRIALS" --seed 0 \
    --max-new-tokens 32 --output "$OUT/self-sd/$NAME.json" --study-path "$OUT/self-sd/$NAME.optuna.db" --force
time selfspec train-heads --kind lm-heads -m "$MODEL" --prompt-file "$CAL" -n "$TOKENS" --output "$OUT/adadecode/$NAME" --force
time selfspec train-heads --kind exit-mlp -m "$MODEL" --prompt-file "$CAL" -n "$TOKENS" --heads "$OUT/adadecode/$NAME" \
    --output "$OUT/specee/$NAME" --force
time selfspec calibrate --method specee -m "$MODEL" --prompt-file "$CAL" --num-prompts 16 --max-new-tokens 128 \
    --output "$OUT/specee/$NAME.schedule.json" --force
