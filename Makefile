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

test: setup
	$(VENV)/bin/python -m pytest -q --durations=12

# a fast subset for local iteration (no Ray, no engine); `make test` is the check
test-unit: setup
	$(VENV)/bin/python -m pytest -q tests/unit

docs: setup
	$(VENV)/bin/colocate config-docs > docs/config.md
