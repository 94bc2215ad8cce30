# Two commands a new user needs: `make demo` (the main job) and `make test`.
# Each creates the virtual environment on first use. A torch that the chosen python already has
# (a CUDA build, say) is used as is; otherwise TORCH_SPEC is installed (a CPU build on this kind
# of machine; on other CPU machines pass e.g. TORCH_SPEC="torch --index-url <cpu wheel index>").
# A python that is itself a virtual environment's does not count: the new one would see its
# base's packages, not that environment's torch, and pip would fetch the newest torch.
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint clean

$(STAMP): pyproject.toml
	@if $(PY) -c "import sys, torch; sys.exit(sys.prefix != sys.base_prefix)" 2>/dev/null; then \
	  echo "using the torch that $(PY) already has"; \
	  $(PY) -m venv --system-site-packages $(VENV); \
	else \
	  $(PY) -m venv $(VENV) && $(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"; \
	fi
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]"
	@touch $@

# The quick sweep (about 5 minutes on 2 cores: results/quick/README.md says how it was timed);
# results/quick holds a committed copy.
demo: $(STAMP)
	$(BIN)/flexbench sweep experiments/configs/quick.toml --out runs/quick
	$(BIN)/flexbench report runs/quick

test: $(STAMP)
	$(BIN)/python -m pytest -q
	$(BIN)/ruff check .

# The tests that start no process (no ranks, launchers or CLIs): the loop while editing.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not dist"

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs
