# Two commands on a fresh machine: `make train` and `make test`. Both create the virtual
# environment .venv on first use; `make train` installs what training needs (the package),
# `make test` adds the dev extras (test tools and the rival libraries the tests compare
# against). Without an NVIDIA GPU the CPU build of torch is installed first; with one,
# bring your own CUDA build of torch (any version in pyproject.toml's range) or let pip
# pick one.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TRAIN_STAMP := $(VENV)/.installed-train
DEV_STAMP := $(VENV)/.installed-dev
TORCH_CPU ?= torch==2.13.0
ARGS ?=

.PHONY: install train test lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(TRAIN_STAMP): pyproject.toml | $(PY)
	@if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c "import torch" 2>/dev/null; then \
		echo "no NVIDIA GPU: installing the CPU build $(TORCH_CPU)"; \
		$(PY) -m pip install --quiet "$(TORCH_CPU)"; \
	fi
	$(PY) -m pip install --quiet -e .
	touch $@

# The dev extras on top of the package (after `make train`, only what they add).
$(DEV_STAMP): $(TRAIN_STAMP)
	$(PY) -m pip install --quiet -e ".[dev]"
	@# DeepSpeed builds its CPU shared-memory all-reduce when a ZeRO run first starts on a
	@# CPU (20 s or more, every rank waiting). The default run (distributed=unsharded) never
	@# does; the tests launch ZeRO on the CPU, so their install builds it into the cache.
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "building DeepSpeed's CPU all-reduce extension (once, about 20 s)"; \
		DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; \
			ShareMemCommBuilder().load(verbose=False)" >/dev/null 2>&1 \
			|| echo "warning: DeepSpeed's CPU extension did not build; ZeRO on CPU builds it at its first launch"; \
	fi
	touch $@

install: $(DEV_STAMP)

train: $(TRAIN_STAMP)
	$(PY) -m collage_train $(ARGS)

# The suite starts some hundred interpreters and two workers that rewrite every test
# module's asserts: with PYTHONDONTWRITEBYTECODE set (some images set it), each would
# compile the package and the rewritten tests from source again.
test: $(DEV_STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=25 $(ARGS)

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) outputs build dist *.egg-info
