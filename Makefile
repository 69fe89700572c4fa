# Everything a fresh machine needs: `make serve` runs the daemon, `make test` the tests.
# The virtual environment is built on first use. TORCH pins the CPU build on machines
# without a GPU; on a GPU machine set TORCH=torch (or keep the torch you have).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
EXTRAS ?= dev,transformers

.PHONY: env test serve clean

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

test: env
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
