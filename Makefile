# `make run`: set up .venv, install, fetch the embedded default model, run a real generation.
# `make test`: the same set-up plus the test extras, then pytest.
VENV := .venv
PY := $(VENV)/bin/python
# jax >= 0.11 needs Python >= 3.12: take the first such interpreter on PATH, else the oldest
# such one under pyenv (3.12 first: the lent H200 runs 3.12).
FIND_PYTHON := for p in python3.12 python3.13 python3.14 python3 python; do \
	  if $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then command -v $$p; exit 0; fi; \
	done; \
	root=$$(pyenv root 2>/dev/null || echo $$HOME/.pyenv); \
	for v in $$(ls $$root/versions 2>/dev/null | grep -E '^3\.(1[2-9])(\.|$$)' | sort -V); do \
	  if [ -x $$root/versions/$$v/bin/python ]; then echo $$root/versions/$$v/bin/python; exit 0; fi; \
	done; exit 1
PROMPT ?= What is the capital of France?
# `make run V=1`: also the load time, time to first token and decode speed (jaxinfer -v).
V ?=

.PHONY: run test venv clean test-packages compiler

$(VENV)/.created:
	@base=$$($(FIND_PYTHON)) || { echo "error: no Python >= 3.12 found (jax >= 0.11 needs it); install one, e.g. 'pyenv install 3.12'" >&2; exit 1; }; \
	echo "using $$base"; $$base -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	touch $@

$(VENV)/.installed: $(VENV)/.created pyproject.toml
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

# A C++ compiler: the CPU's quantized matmul kernel (pallas_kernels/cpu_quantized.cc) is built
# with it on first use; without one, quantized weights run on XLA's ~3x slower tiles.
compiler:
	@command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ \
	      || echo "note: could not install g++"; \
	  else echo "note: no C++ compiler (apt-get install g++): quantized weights on the CPU \
	run on XLA's slower path"; fi; }

run: $(VENV)/.installed compiler
	$(VENV)/bin/jaxinfer $(if $(V),-v) generate "$(PROMPT)"

# Debian packages the tests use, installed here when missing and we are root with apt-get:
# chromium (the chat page's browser test drives the distribution's Chromium; no browser
# download; without it that test skips) and libjemalloc2 (the suite runs under jemalloc:
# XLA's CPU compiles spent ~14% of their time in glibc's malloc; the suite's pytest took 707-748 s
# against 752-793 s, benchmarks/DECISIONS.md; without it, glibc's).
JEMALLOC_LIB := ls /usr/lib/*/libjemalloc.so.2 /usr/lib/libjemalloc.so.2 2>/dev/null | head -1
test-packages:
	@missing=""; \
	[ -x /usr/bin/chromium ] || command -v chromium >/dev/null 2>&1 || missing=" chromium"; \
	[ -n "$$($(JEMALLOC_LIB))" ] || missing="$$missing libjemalloc2"; \
	if [ -n "$$missing" ]; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && for pkg in $$missing; do \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$pkg \
	        || echo "note: could not install $$pkg"; done; \
	  else echo "note: missing$$missing (apt-get install$$missing): without chromium the chat \
	page's test skips, without jemalloc the suite runs slower"; fi; \
	fi

# Two workers for the two cores. (The worker crashes once seen in XLA CPU compiles were the
# process running out of memory maps: tests/conftest.py keeps it under vm.max_map_count.)
# The suite's processes (and those they start) under jemalloc where it is installed.
test: $(VENV)/.installed-test test-packages compiler
	@lib=$$($(JEMALLOC_LIB)); \
	env $${lib:+LD_PRELOAD="$$lib"} $(PY) -m pytest -n 2 --dist worksteal -q

clean:
	rm -rf $(VENV)
