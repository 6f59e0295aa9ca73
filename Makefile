# One entry point for newcomers and CI: `make demo` and `make test` set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test check lint lint-deploy typecheck unit bench clean ts-deps ts-schema

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

# the TypeScript client's one devDependency (typescript, from its lockfile), for tests/e2e/test_typescript_client.py;
# without npm those tests skip (and fail under CI)
TS_CLIENT := clients/typescript
ts-deps:
	@if command -v npm >/dev/null 2>&1 && [ ! -x $(TS_CLIENT)/node_modules/.bin/tsc ]; then \
		cd $(TS_CLIENT) && npm ci --no-audit --no-fund; fi

# regenerate the client's types from the API's OpenAPI document (no server needed), after a change of its bodies
ts-schema: setup
	$(BIN)/python -c 'import json; from broker_config.settings import Settings; from workers.api.app import make_api; \
		print(json.dumps(make_api(Settings(api_tokens="unused")).openapi()))' \
		| node $(TS_CLIENT)/scripts/schema.mjs > $(TS_CLIENT)/src/schema.ts.new
	mv $(TS_CLIENT)/src/schema.ts.new $(TS_CLIENT)/src/schema.ts

# the suite in PYTEST_WORKERS processes, a test file to each at a time (its fixtures and servers stay its own)
PYTEST_WORKERS ?= 2
unit: setup ts-deps
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile

test: check unit

bench: setup
	$(BIN)/python bench/history.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .coverage .coverage.* *.egg-info
	rm -rf $(TS_CLIENT)/node_modules $(TS_CLIENT)/dist
