#!/usr/bin/env bash
# A non-editable install works (issue 24, item 8): `pip install --no-deps` of this tree into a
# fresh venv that sees the system's packages (torch and the other dependencies: nothing big is
# downloaded), then, from a temporary directory and with the source tree gone, `selfspec
# generate` with every method on the shipped code model and its shipped artifacts, the engine's
# kernel compiled from the installed source. .ci/run runs it after the tests (~1-2.5 min here).
# pip builds the wheel in an isolated environment: setuptools>=68 comes from the package index.
#   bash scripts/check_install.sh            # N=4 tokens per prompt; PYTHON=python3
# The venv sits at a fixed path ($SELFSPEC_INSTALL_CHECK_DIR, default $TMPDIR/selfspec-install-check),
# recreated each run, so the kernel built for its copy of the source is reused by the next run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
N=${N:-4}
CHECK_DIR=${SELFSPEC_INSTALL_CHECK_DIR:-${TMPDIR:-/tmp}/selfspec-install-check}
VENV=$CHECK_DIR/venv
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
t0=$SECONDS

# A copy of the tree as git sees it (tracked and untracked-but-not-ignored files, symlinks kept),
# so a stale build/ or a local run's leftovers cannot reach the wheel.
mkdir "$WORK/src"
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard | tar --null -T - --ignore-failed-read -cf - 2> /dev/null | tar -xf - -C "$WORK/src"
else
  tar --exclude=./build --exclude='*.egg-info' -cf - . | tar -xf - -C "$WORK/src"
fi
head -2 examples/prompts.jsonl > "$WORK/prompts.jsonl"

"$PYTHON" -m venv --clear --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$WORK/src"
rm -rf "$WORK/src"
echo "check_install: venv and non-editable install in $((SECONDS - t0)) s" >&2

# From elsewhere, with nothing pointing back at a checkout: no PYTHONPATH, no artifacts override,
# an empty user data directory (user-made artifacts are looked up before the shipped ones).
cd "$WORK"
unset PYTHONPATH SELFSPEC_ARTIFACTS
export SELFSPEC_HOME="$WORK/home"
"$VENV/bin/python" - "$VENV" <<'EOF'
import sys
from pathlib import Path
import selfspec_cli
from selfspec_cli import loading
venv = Path(sys.argv[1]).resolve()
where = {"package": Path(selfspec_cli.__file__), "artifacts": loading.ARTIFACTS_DIR,
         "code model": loading.CODE_MODEL_DIR, "examples": loading.EXAMPLES_DIR}
for name, path in where.items():
    if not (path.exists() and path.resolve().is_relative_to(venv)):
        sys.exit(f"check_install: the installed {name} is {path}, not inside {venv}")
print(f"check_install: selfspec_cli from {where['package'].parent}", file=sys.stderr)
EOF
# The kernel, built from the installed csrc/ (first run at this venv path) or loaded, once, before
# the generate runs share it. The build directory is keyed by the source's path and bytes; the
# installed file's mtime is set to a fixed past time so that reinstalling the same bytes does not
# make ninja rebuild it (~30 s) on every run.
src=$("$VENV/bin/python" -c "from selfspec_cli.engine import kernels; print(kernels._SOURCE)")
touch -d @946684800 "$src"
"$VENV/bin/python" -c "from selfspec_cli.engine.kernels import main; main()"
methods=$("$VENV/bin/python" -c "from selfspec_cli.methods import METHODS; print(' '.join(METHODS))")
run_one() {  # one method: exit status 0 and two records of 1..N new tokens, made by that method
  local m=$1
  if ! "$VENV/bin/selfspec" generate --model pystdlib -p prompts.jsonl -n "$N" --method "$m" > "out-$m.jsonl" 2> "err-$m.txt"; then
    echo "check_install: FAILED: selfspec generate --model pystdlib --method $m" >&2; tail -3 "err-$m.txt" >&2; return 1
  fi
  "$VENV/bin/python" -c '
import json, sys
path, method, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
recs = [json.loads(line) for line in open(path)]
ok = len(recs) == 2 and all(r["method"] == method and 0 < r["new_tokens"] <= n for r in recs)
sys.exit(0 if ok else f"check_install: {method}: unexpected records {recs}")' "out-$m.jsonl" "$m" "$N" || return 1
  echo "check_install: $m ok" >&2
}
export -f run_one
export VENV N
# two at a time (each runs one torch thread): most of a run is importing torch and transformers
if ! printf '%s\n' $methods | xargs -P "${JOBS:-2}" -I{} bash -c 'run_one "$1"' _ {}; then
  echo "check_install: FAILED (above)" >&2; exit 1
fi
# The offline steps are imported by module name from their method's package (methods/offline.py):
# one calibration and one training from the installed package, each writing its artifact under
# $SELFSPEC_HOME and printing one JSON summary.
printf '%s\n' '{"prompt": "def parse(line):"}' '{"prompt": "import os"}' '{"prompt": "class Cache:"}' > train.jsonl
for step in "calibrate --method fr-spec" "train-heads --kind lm-heads --epochs 1 --rank 4"; do
  if ! "$VENV/bin/selfspec" $step --model pystdlib -p train.jsonl --num-prompts 3 -n 4 > step.json 2> step.err; then
    echo "check_install: FAILED: selfspec $step" >&2; tail -3 step.err >&2; exit 1
  fi
  "$VENV/bin/python" -c 'import json, sys; a = json.load(open("step.json"))["artifact"]; sys.exit(0 if a.startswith(sys.argv[1]) else f"artifact {a}")' "$SELFSPEC_HOME"
  echo "check_install: selfspec $step ok" >&2
done
# chat from the installed package: two turns in, two answers out (one line each, at most N tokens)
if ! printf 'def parse(line):\nimport os\n' | "$VENV/bin/selfspec" chat --model pystdlib -n "$N" > chat.txt 2> chat.err; then
  echo "check_install: FAILED: selfspec chat" >&2; tail -3 chat.err >&2; exit 1
fi
[ "$(grep -c 'tokens in' chat.err)" = 2 ] || { echo "check_install: FAILED: selfspec chat answered $(grep -c 'tokens in' chat.err) of 2 turns" >&2; exit 1; }
echo "check_install: selfspec chat ok" >&2
echo "check_install: non-editable install ok: generate with every method ($methods), a calibration, a training and a chat from $WORK, $((SECONDS - t0)) s" >&2
