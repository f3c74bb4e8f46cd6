#!/usr/bin/env bash
# Rebuild every committed artifact of the shipped model after its weights change
# (each artifact carries the model fingerprint, so old ones are refused).
# Order matters: the SpecEE predictors draft with the shallowest AdaDecode head, and
# the SpecEE schedule needs the predictors. Each step prints its timing on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
M=pystdlib-llama-12x256
CAL=examples/calibration.jsonl

# the Optuna study belongs to the old weights: start a fresh one
rm -f "artifacts/self-sd/$M.optuna.db"
time selfspec calibrate --method self-sd --dataset "$CAL" --trials 100 --seed 0 --max-new-tokens 48
time selfspec train-heads --kind lm-heads --prompt-file "$CAL"
time selfspec train-heads --kind exit-mlp --prompt-file "$CAL"
time selfspec calibrate --method specee --prompt-file "$CAL" --num-prompts 16 --max-new-tokens 128
