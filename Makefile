# The two commands of the README:
#   make run    set up (once) and run the embedded default job on the CPU
#   make test   set up (once) and run the test suite
VENV ?= .venv
STAMP := $(VENV)/.colocate-setup

.PHONY: setup run test test-unit docs
setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	VENV=$(VENV) bash scripts/setup.sh
	touch $(STAMP)

run: setup
	$(VENV)/bin/colocate launch

# Two test files at a time (pytest-xdist; a file's tests stay together, so a module's shared cluster or runtime
# starts once): the end-to-end tests wait on Ray and vLLM much of the time, and two of them fill the 2 cores
# one leaves idle. Their leak checks count only what their own worker started (tests/e2e/conftest.py). Files
# go out heaviest first, in the order tests/conftest.py gives them. ruff first (about a second): pyflakes' findings
# and lines over 120 columns ([tool.ruff] in pyproject.toml) stop the run before the suite's minutes.
test: setup
	$(VENV)/bin/ruff check colocate tests
	$(VENV)/bin/python -m pytest -q --durations=12 -n 2 --dist loadfile --no-loadscope-reorder

# a fast subset for local iteration (no Ray, no engine); `make test` is the check
test-unit: setup
	$(VENV)/bin/python -m pytest -q tests/unit

docs: setup
	$(VENV)/bin/colocate config-docs > docs/config.md
