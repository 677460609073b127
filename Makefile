# Two entry points for a fresh machine (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv servers lint typecheck unit asyncio-pass clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
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

typecheck: venv
	$(BIN)/mypy

unit: venv servers
	$(BIN)/pytest

# The balancing core is written against anyio: run its tests on asyncio too,
# the core Nacos and Kubernetes flows through the owner, the console/metrics
# apps, and the calling path's (errors, verbs, change iteration).
asyncio-pass: venv
	TEST_BACKEND=asyncio $(BIN)/pytest tests/poise tests/providers/nacos/test_owner_anyio.py \
		tests/providers/kubernetes/test_owner_anyio.py tests/observability/test_asyncio.py \
		tests/nadisc/test_calling_errors.py \
		tests/nadisc/test_rest_verbs.py tests/nadisc/test_observation_changes.py \
		-o trio_mode=false -m "not trio_only" -q

test: lint typecheck unit asyncio-pass

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
