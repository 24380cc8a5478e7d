# loralei developer commands. `make install` is idempotent; `make test` runs the CPU suite (what CI runs).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Without a torch already in the venv we install the CPU build: PyTorch's CPU index is tried next to PyPI, and
# its "+cpu" wheel outranks PyPI's CUDA wheel of the same version, so no multi-GB CUDA build is pulled by accident.
# For CUDA, install the torch build you want into $(VENV) first; `make install` then leaves it alone.
TORCH_SPEC ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: install test quickstart demo lint format clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || \
		$(PIP) install --retries 1 --timeout 20 --extra-index-url $(TORCH_CPU_INDEX) "$(TORCH_SPEC)"
	$(PIP) install -e ".[dev]"
	touch $@

test: install
	$(PY) -m pytest -q

# The README's main command: a tiny model learns a small chat task (writing a word in capitals) on the CPU in about
# a minute, then answers 30 held-out prompts it never saw, before and after training, and scores the answers.
quickstart: install
	$(VENV)/bin/loralei-finetune examples/quickstart.yaml
	$(VENV)/bin/loralei-generate outputs/quickstart/adapter --compare-base --max-new-tokens 12 \
		--eval examples/quickstart/heldout.jsonl

demo: install
	$(PY) examples/api_tour.py

lint: install
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

format: install
	$(VENV)/bin/ruff format src tests benchmarks examples
	$(VENV)/bin/ruff check --fix src tests benchmarks examples

clean:
	rm -rf $(VENV) build dist src/*.egg-info
