# Two commands on a fresh machine: `make train` and `make test`. Both create and
# fill the virtual environment .venv on first use. Without an NVIDIA GPU the CPU
# build of torch is installed first; with one, bring your own CUDA build of torch
# (any version in pyproject.toml's range) or let pip pick one.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_CPU ?= torch==2.13.0
ARGS ?=

.PHONY: install train test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c "import torch" 2>/dev/null; then \
		echo "no NVIDIA GPU: installing the CPU build $(TORCH_CPU)"; \
		$(PY) -m pip install --quiet "$(TORCH_CPU)"; \
	fi
	$(PY) -m pip install --quiet -e ".[dev]"
	@# DeepSpeed builds its CPU shared-memory all-reduce when a ZeRO run first starts on a
	@# CPU (20 s or more, every rank waiting); the install builds it into the same cache.
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "building DeepSpeed's CPU all-reduce extension (once, about 20 s)"; \
		DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; \
			ShareMemCommBuilder().load(verbose=False)" >/dev/null 2>&1 \
			|| echo "warning: DeepSpeed's CPU extension did not build; ZeRO on CPU builds it at its first launch"; \
	fi
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(PY) -m collage_train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=25 $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) outputs build dist *.egg-info
