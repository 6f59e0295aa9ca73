# One entry point for newcomers and CI: `make demo` and `make test` set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test check lint lint-deploy typecheck unit bench clean

$(BIN)/forkq: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[all,dev]'
	touch $@

setup: $(BIN)/forkq

demo: setup
	$(BIN)/forkq demo

lint: setup
	$(BIN)/ruff check workers broker_config tests bench
	$(BIN)/ruff format --check workers broker_config tests bench

typecheck: setup
	$(BIN)/mypy

# deploy/: the checker script itself (ruff, mypy --strict), then hadolint, yamllint, the compose
# schema, kubernetes-validate and KEDA's schema (deploy/lint.sh)
lint-deploy: setup
	$(BIN)/ruff check deploy
	$(BIN)/ruff format --check deploy
	$(BIN)/mypy --strict deploy/check_deploy.py
	bash deploy/lint.sh

check: lint typecheck lint-deploy

unit: setup
	$(BIN)/pytest

test: check unit

bench: setup
	$(BIN)/python bench/history.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .coverage .coverage.* *.egg-info
