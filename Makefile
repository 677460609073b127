# Two entry points for a fresh machine (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv servers hypothesis-data bytecode lint typecheck unit asyncio-pass clean

# Python's bytecode cache stays on for everything make runs, even where the
# environment turns it off (some container images set
# PYTHONDONTWRITEBYTECODE): without it every test worker and every server
# process the tests start compiles each module again, and pytest rewrites
# the asserts of every test module again in each worker (about 15 s of CPU
# per worker, six workers at once).
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,grpc]'
	touch $(STAMP)

venv: $(STAMP)

# Real servers (and the openssl command for the TLS test certificate, and
# kubectl as a real client of the Kubernetes API fake) used
# by the integration tests. The tests start their own throw-away instances on
# loopback ports; this only makes the binaries exist.
servers:
	@if ! command -v etcd >/dev/null 2>&1 || ! command -v dnsmasq >/dev/null 2>&1 \
		|| ! command -v openssl >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1; then \
		echo "installing etcd-server, dnsmasq-base, openssl and chromium"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			etcd-server dnsmasq-base openssl chromium >/dev/null; \
	fi
	@# promtool (Debian's prometheus package) checks the metrics exposition and
	@# the documented alert rules; tmux runs `nadisc watch` in a real terminal.
	@if ! command -v promtool >/dev/null 2>&1 || ! command -v tmux >/dev/null 2>&1; then \
		echo "installing prometheus (promtool) and tmux"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends prometheus tmux >/dev/null; \
	fi
	@# kubectl drives the Kubernetes fake's tests (any kubectl on PATH will do; the
	@# image may ship one already, which Debian's package would conflict with).
	@if ! command -v kubectl >/dev/null 2>&1; then \
		echo "installing kubernetes-client (kubectl)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			kubernetes-client >/dev/null; \
	fi

demo: venv
	$(BIN)/python -m nadisc.demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

# Both passes run in parallel worker processes (pytest-xdist); each worker
# starts its own throw-away servers. Most tests wait on timers and real
# servers rather than the CPU, so the workers outnumber the 2 cores. Work is
# stolen between workers, so one slow file does not hold the others up.
WORKERS ?= 3
XDIST := -n $(WORKERS) --dist worksteal

# Hypothesis builds its table of Unicode categories the first time a test
# draws text (about 6 s of CPU) and keeps it in .hypothesis/. Built here
# once, before the passes start, instead of by every worker of both passes
# at the same time.
hypothesis-data: venv
	$(BIN)/python -W ignore -c "from hypothesis import strategies as st; st.text(min_size=1).example()"

# The test modules' rewritten bytecode (and the package's), written once
# by one collection before the passes start instead of by every worker
# (its output is shown only when the collection fails).
bytecode: venv
	@$(BIN)/pytest --collect-only -q -p no:cacheprovider >$(VENV)/collect.log 2>&1 \
		|| { cat $(VENV)/collect.log; exit 1; }

unit: venv servers hypothesis-data bytecode
	$(BIN)/pytest $(XDIST) --durations=25

# Everything is written against anyio and claimed to work on asyncio: run the
# loop-dependent (async) tests of the core, the runtime, the providers, the
# fakes and the docs' examples on asyncio too. Tests on trio's virtual clock
# are trio-only by construction (see tests/conftest.py); plain tests already
# ran on the trio pass.
ASYNCIO_PATHS := tests/poise tests/nadisc tests/providers tests/fakes tests/docs \
	tests/observability/test_asyncio.py tests/observability/test_balancer_failures.py \
	tests/grpc
asyncio-pass: venv servers hypothesis-data bytecode
	TEST_BACKEND=asyncio $(BIN)/pytest $(XDIST) $(ASYNCIO_PATHS) -o trio_mode=false \
		-m "not trio_only" -q

# Lint first (seconds); then the type check and the two test passes side by
# side, each one's output printed whole when it ends.
test: lint
	$(MAKE) --no-print-directory -j3 --output-sync=target typecheck unit asyncio-pass

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
