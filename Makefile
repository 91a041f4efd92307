# Two commands: `make serve` and `make test`. Both create .venv on first use and keep it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
EXTRAS ?= test
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),_,$(EXTRAS))

.PHONY: serve test lint install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/mmenc serve $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
