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

# ar vs Hugging Face generate on the example prompts (the figure in docs/log.md).
bench: setup
	$(PYTHON) -m selfspec_cli bench --methods ar,hf --max-new-tokens 128 --warmup 1 --repeats 3
