# Quick start: `make demo` runs the main job, `make test` runs every check.
# Each sets up .venv itself on a machine with only Python 3.11+ and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the TypeScript SDK's reference MCP servers, pinned by their lock (tests/mcp/test_node_servers.py)
NODE_DIR := tests/mcp/node
NODE_SERVERS := $(NODE_DIR)/node_modules/.installed

.PHONY: demo test lint typecheck unit bench clean browser

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/stopline demo

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP) browser $(NODE_SERVERS)
	$(BIN)/pytest -q

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/stopline bench --quick

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache $(NODE_DIR)/node_modules

# npm ci installs exactly the lock, offline-safe at test time; no node: those tests skip
$(NODE_SERVERS): $(NODE_DIR)/package.json $(NODE_DIR)/package-lock.json
	@if command -v npm >/dev/null; then \
		npm ci --prefix $(NODE_DIR) --no-audit --no-fund && touch $@; \
	else \
		echo "the TypeScript MCP server tests need Node.js 20+ and npm"; \
	fi

# The console's browser tests drive Debian's chromium (never a downloaded build).
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	else \
		echo "browser tests need Debian's chromium: sudo apt-get install chromium chromium-driver"; \
	fi
