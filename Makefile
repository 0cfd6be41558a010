# Set-up and entry points. `make serve` and `make test` do all set-up on a fresh Debian machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch is installed first so nothing pulls the multi-GB CUDA build (where pip is not
# configured with it: make test TORCH_PIP_ARGS='--index-url https://download.pytorch.org/whl/cpu').
TORCH ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install redis serve test test-slow lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/pip || { rm -rf $(VENV); $(PY) -m venv $(VENV); } || { rm -rf $(VENV); [ "$$(id -u)" = 0 ] && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null && \
	  $(PY) -m venv $(VENV); } || { echo "cannot create $(VENV): install python3-venv (sudo apt-get install python3-venv)" >&2; exit 1; }
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" $(TORCH_PIP_ARGS)
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP) redis

# Debian's redis-server, installed when missing (as root); its system service is stopped and disabled
# (it would be back at the next boot) because port 6379 belongs to Ray's GCS (`ray start --head`): tests
# and `radixserve serve` start their own on free ports.
redis:
	@if ! command -v redis-server >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null && \
	    (systemctl disable --now redis-server >/dev/null 2>&1 || service redis-server stop >/dev/null 2>&1 || true); \
	  else \
	    echo "redis-server is missing: install it with 'sudo apt-get install redis-server'" >&2; exit 1; \
	  fi; \
	fi

serve: install
	$(BIN)/radixserve serve

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Long soak runs, kept out of `make test`.
test-slow: install
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

bench: install
	$(BIN)/python -m bench.cache_bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
