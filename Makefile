# One venv, one pinned CPU torch. `make serve` and `make test` set everything up first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: setup serve test bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[test]" "$(TORCH_PIN)"
	$(PY) -m models.fetch
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(PY) -m server $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)
