# Softmax in Triton: the course's commands. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV   := .venv
PY     := $(VENV)/bin/python
# torch and triton for a machine that has neither. On Linux, PyPI's torch is the CUDA build (GBs of CUDA libraries):
# `make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu` takes PyTorch's CPU build of the same version instead.
TORCH       := torch==2.13.0
TRITON      := triton>=3.7
TORCH_INDEX :=
NBVAL  := --nbval-lax --nbval-current-env --nbval-cell-timeout=600

.PHONY: help setup test test-python test-notebooks test-browser notebooks images lab bench lint clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

setup:  ## create .venv and install everything (keeps an existing torch/triton)
	@if python3 -c "import torch, triton" 2>/dev/null; then \
	  echo "torch $$(python3 -c 'import torch; print(torch.__version__)') found: reusing it"; \
	  python3 -m venv --system-site-packages $(VENV); \
	else \
	  python3 -m venv $(VENV) && \
	  $(PY) -m pip install -q --upgrade pip && \
	  $(PY) -m pip install -q "$(TORCH)" "$(TRITON)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)); \
	fi
	$(PY) -m pip install -q -r requirements.txt
	@# the course's helpers, editable: importable from anywhere in the venv (notebooks run from notebooks/)
	$(PY) -m pip install -q -e .
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	@$(PY) -c "import torch, triton; print(f'ready: torch {torch.__version__}, triton {triton.__version__}')"

test: lint test-python test-notebooks  ## lint, then the tests and every notebook (CPU interpreter when there is no GPU)

test-python:  ## pytest on tests/
	$(PY) -m pytest tests -q

test-notebooks:  ## nbval on every notebook
	$(PY) -m pytest $(NBVAL) notebooks -q

test-browser:  ## run every notebook in JupyterLab in headless Chromium (Debian's chromium); screenshots in build/
	$(PY) tests/run_in_browser.py

notebooks:  ## re-execute every notebook in place (the committed outputs come from this, on CPU)
	$(PY) -m helpers.notebooks notebooks/*.ipynb

images:  ## regenerate every figure in images/
	$(PY) -m helpers.figures

lab:  ## open the course in JupyterLab
	$(VENV)/bin/jupyter lab notebooks

bench:  ## GPU benchmark sweeps: writes results/<gpu>*.csv, then redraws the plots in images/
	$(PY) -m helpers.bench
	$(PY) -m helpers.steps
	$(PY) -m helpers.bench_attention
	$(PY) -m helpers.figures

lint:  ## ruff on helpers, tests and notebooks
	$(PY) -m ruff check .

clean:  ## remove the virtual environment and caches
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
