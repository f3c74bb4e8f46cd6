#!/usr/bin/env bash
# Rebuild every committed artifact of the shipped model after its weights change
# (each artifact carries the model fingerprint, so old ones are refused).
# Order matters: the SpecEE predictors draft with the shallowest AdaDecode head, and
# the SpecEE schedule needs the predictors. Each step prints its timing on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
M=pystdlib-llama-12x256
CAL=examples/calibration.jsonl

# The shipped tree is read-only data by default (user artifacts go to $SELFSPEC_HOME):
# this script writes it on purpose, with explicit --output paths and --force.
A=artifacts
# the Optuna study belongs to the old weights: start a fresh one
rm -f "$A/self-sd/$M.optuna.db"
time selfspec calibrate --method self-sd --dataset "$CAL" --trials 100 --seed 0 --max-new-tokens 48 \
    --output "$A/self-sd/$M.json" --force
time selfspec train-heads --kind lm-heads --prompt-file "$CAL" --output "$A/adadecode/$M" --force
time selfspec train-heads --kind exit-mlp --prompt-file "$CAL" --heads "$A/adadecode/$M" --output "$A/specee/$M" --force
time selfspec calibrate --method specee --prompt-file "$CAL" --num-prompts 16 --max-new-tokens 128 \
    --output "$A/specee/$M.schedule.json" --force
