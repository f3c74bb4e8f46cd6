# One command sets up and runs the main job; one sets up and runs the tests.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: setup demo test bench
setup:
	@$(PIP) torch==2.13.0
	@$(PIP) -e ".[test]"

# Greedy continuations of the example prompts by the shipped model (JSONL on stdout).
demo: setup
	$(PYTHON) -m selfspec_cli generate --prompt-file examples/prompts.jsonl --max-new-tokens 64

test: setup
	$(PYTHON) -m pytest -q

# Every method and peer on the default suite (pystdlib, 80 prompts x 64 tokens); see docs/benchmarks.md.
bench: setup
	$(PYTHON) -m selfspec_cli bench --output-dir bench-out
