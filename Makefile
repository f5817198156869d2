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

.PHONY: run test venv clean chromium

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

run: $(VENV)/.installed
	$(VENV)/bin/jaxinfer $(if $(V),-v) generate "$(PROMPT)"

# The chat page's browser test drives the distribution's Chromium (Debian's package; no
# browser download): installed here when missing and we are root with apt-get, else it skips.
chromium:
	@if [ ! -x /usr/bin/chromium ] && ! command -v chromium >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else echo "note: no chromium (apt-get install chromium); the chat page's test will skip"; fi; \
	fi

# Two workers for the two cores. (The worker crashes once seen in XLA CPU compiles were the
# process running out of memory maps: tests/conftest.py keeps it under vm.max_map_count.)
test: $(VENV)/.installed-test chromium
	$(PY) -m pytest -n 2 --dist worksteal -q

clean:
	rm -rf $(VENV)
