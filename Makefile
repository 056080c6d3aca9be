# One venv, one pinned CPU torch, every other package pinned by constraints.txt (CI and the
# Dockerfile install from it too). `make serve` and `make test` set everything up first.
# `make lock` rewrites constraints.txt from what .venv holds: run it after upgrading on purpose.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
CONSTRAINTS := constraints.txt

.PHONY: setup serve test bench lock

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e ".[test]" "$(TORCH_PIN)"
	$(PY) -m models.fetch
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(PY) -m server $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

# Everything installed in .venv but torch (pinned above), its CUDA packages and pagedserve itself.
lock: setup
	{ sed -n '/^#/p' $(CONSTRAINTS); $(PY) -m pip freeze --exclude-editable \
	    | grep -viE '^(torch|triton|nvidia-[a-z0-9-]*|pagedserve)=='; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)
