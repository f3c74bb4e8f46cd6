#!/usr/bin/env bash
# Issue 14's check: the shipped artifacts' bytes are unchanged after running the README's and
# docs' commands with their default output locations. Sizes are cut (--trials, -n, prompts)
# so it runs in minutes; what decides where a command writes is unchanged.
#   bash scripts/check_shipped_untouched.sh            # uses a fresh temporary SELFSPEC_HOME
set -euo pipefail
cd "$(dirname "$0")/.."
# the cache (kernel, converted model) stays where it is: only artifacts go to the temporary home
export SELFSPEC_CACHE=${SELFSPEC_CACHE:-$(python -c 'from selfspec_cli.paths import cache_root; print(cache_root())')}
export SELFSPEC_HOME=${SELFSPEC_HOME:-$(mktemp -d)}
WORK=$(mktemp -d)
snapshot() { find artifacts -type f ! -name '*.optuna.db' -print0 | sort -z | xargs -0 sha256sum; }
snapshot > "$WORK/before"
head -2 examples/questions.jsonl > "$WORK/q.jsonl"
run() { echo "+ $*" >&2; "$@" > /dev/null 2>> "$WORK/stderr" || { echo "FAILED: $*" >&2; tail -3 "$WORK/stderr" >&2; exit 1; }; }
run selfspec generate --prompt-file "$WORK/q.jsonl" -n 4
for m in self-sd asd swift adadecode specee pld auto; do run selfspec generate -p "$WORK/q.jsonl" -n 4 --method "$m"; done
run selfspec calibrate --method self-sd --prompt-file examples/chat-calibration.jsonl --num-prompts 1 --trials 1 -n 4 --repeats 1
run selfspec calibrate --method self-sd -m pystdlib --prompt-file examples/calibration.jsonl --num-prompts 1 --trials 1 -n 4 --repeats 1
run selfspec train-heads --kind lm-heads --num-prompts 2 -n 8 --epochs 1
run selfspec train-heads --kind exit-mlp --num-prompts 2 -n 8 --epochs 1
run selfspec calibrate --method specee --prompt-file examples/chat-calibration.jsonl --num-prompts 1 -n 4
run selfspec calibrate --method fr-spec --prompt-file examples/chat-calibration.jsonl --num-prompts 2 -n 8
(cd "$WORK" && run selfspec bench --methods ar,hf -p q.jsonl -n 4 --no-costs && run selfspec profile -p q.jsonl --rounds 1 --redundancy-prompts 1 --redundancy-tokens 1)
snapshot > "$WORK/after"
if diff "$WORK/before" "$WORK/after"; then
  echo "shipped artifacts unchanged ($(wc -l < "$WORK/after") files); user artifacts went to $SELFSPEC_HOME:" >&2
  find "$SELFSPEC_HOME" -type f | sed "s|$SELFSPEC_HOME|  \$SELFSPEC_HOME|" >&2
else
  echo "SHIPPED ARTIFACTS CHANGED" >&2; exit 1
fi
