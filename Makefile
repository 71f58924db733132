# The two commands of the README: `make demo` and `make test`. Both create .venv and install into it.
# On a machine without an NVIDIA GPU, torch is pinned to the local CPU build (2.13.0) first: any looser
# requirement pulls several GB of CUDA packages.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_CPU := torch==2.13.0
# Extras `make test` installs: everything testable on a CPU machine (see README, "Dependencies").
TEST_EXTRAS := openvino,tvm,launch,kernels,viz,dev
DEMO_DIR := build/demo

.PHONY: demo test test-unit test-exhaustive lint install-core install-test clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Demo install: tessera with OpenVINO (a second backend for `place`) and torch (the CPU build when
# there is no NVIDIA GPU) for `launch`.
$(VENV)/.core: pyproject.toml | $(VENV)/bin/activate
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q $(TORCH_CPU); fi
	$(PIP) install -q -e ".[openvino,launch,viz]"
	touch $@

$(VENV)/.test: pyproject.toml | $(VENV)/bin/activate
	@if ! command -v nvidia-smi >/dev/null 2>&1; then echo "no NVIDIA GPU: installing the CPU build $(TORCH_CPU)"; $(PIP) install -q $(TORCH_CPU); fi
	$(PIP) install -q -e ".[$(TEST_EXTRAS)]"
	touch $@ $(VENV)/.core

install-core: $(VENV)/.core
install-test: $(VENV)/.test

demo: $(VENV)/.core
	@mkdir -p $(DEMO_DIR)
	$(VENV)/bin/tessera zoo build mmt --size tiny -o $(DEMO_DIR)/mmt.onnx
	$(VENV)/bin/tessera inspect $(DEMO_DIR)/mmt.onnx
	$(VENV)/bin/tessera zoo build resnext --size tiny -o $(DEMO_DIR)/resnext.onnx
	$(VENV)/bin/tessera place $(DEMO_DIR)/resnext.onnx --backends onnxruntime,openvino --cache $(DEMO_DIR)/profiles.sqlite \
		--verify -o $(DEMO_DIR)/resnext.place.json
	$(VENV)/bin/tessera zoo build candle_uno --size paper -o $(DEMO_DIR)/candle_uno.onnx
	$(VENV)/bin/tessera inspect $(DEMO_DIR)/candle_uno.onnx --top 5
	$(VENV)/bin/tessera plan $(DEMO_DIR)/candle_uno.onnx --kind gpp --cluster graphpipe-v100 --mini-batch 512 \
		-o $(DEMO_DIR)/candle_uno.gpp.json
	$(VENV)/bin/tessera validate $(DEMO_DIR)/candle_uno.gpp.json
	$(VENV)/bin/tessera plan $(DEMO_DIR)/mmt.onnx --kind spp --cluster local-cpu-split --mini-batch 16 -o $(DEMO_DIR)/mmt.spp.json
	$(VENV)/bin/tessera launch $(DEMO_DIR)/mmt.spp.json --steps 3
	$(VENV)/bin/tessera zoo build gpt --size tiny -o $(DEMO_DIR)/gpt.onnx
	$(VENV)/bin/python -c "import numpy as np; np.save('$(DEMO_DIR)/text.npy', np.frombuffer(open('README.md', 'rb').read(), np.uint8) % 128)"
	$(VENV)/bin/tessera plan $(DEMO_DIR)/gpt.onnx --kind gpp --cluster local-cpu-split --devices 2 --mini-batch 8 \
		-o $(DEMO_DIR)/gpt.gpp.json
	$(VENV)/bin/tessera launch $(DEMO_DIR)/gpt.gpp.json --data $(DEMO_DIR)/text.npy --optimizer adamw --lr 3e-3 \
		--lr-schedule cosine --warmup-steps 5 --max-grad-norm 1.0 --steps 60 --save-model $(DEMO_DIR)/gpt.trained.onnx
	$(VENV)/bin/tessera plan $(DEMO_DIR)/gpt.trained.onnx --kind cp --cluster local-cpu-split --batch 1 --context 8 \
		--output-len 8 --strategy cp --degree 2 -o $(DEMO_DIR)/gpt.cp.json
	printf '116 101 115 115 101 114 97 32\n' > $(DEMO_DIR)/prompt.txt
	$(VENV)/bin/tessera launch $(DEMO_DIR)/gpt.cp.json --prompts $(DEMO_DIR)/prompt.txt --new-tokens 8
	$(VENV)/bin/tessera plan --kind cp --llm llama-7b --cluster a5000-4x --batch 32 --layers 1 \
		--context 32K --sweep-context 1K,4K,10K,32K,100K -o $(DEMO_DIR)/llama.cp.json

# The tests run in one process per core (pytest-xdist; at most 4: each launch test starts its own ranks),
# then those that measure this machine's speed (marked `alone`) in one process with nothing beside them.
test: $(VENV)/.test
	$(PY) -m pytest -q -n auto --maxprocesses 4 -m "not alone and not exhaustive" --durations=30
	$(PY) -m pytest -q -m alone

# Every export form of the corpus on every strategy, beyond make test's sample (about 20 minutes on
# 2 cores): each form launched with tp and dp, each form of a dynamic batch trained on 2 stages.
test-exhaustive: $(VENV)/.test
	$(PY) -m pytest -q -n auto --maxprocesses 4 -m exhaustive --durations=10

# The quick loop while developing: the tests outside the real-export corpus (tests/corpus), less those
# marked slow or alone (make test runs them all).
test-unit: $(VENV)/.test
	$(PY) -m pytest -q -n auto --maxprocesses 4 -m "not corpus and not slow and not alone"

lint: $(VENV)/.test
	$(VENV)/bin/ruff format --check tessera tests bench
	$(VENV)/bin/ruff check tessera tests bench

clean:
	rm -rf $(VENV) build .pytest_cache
