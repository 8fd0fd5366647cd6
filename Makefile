# The two commands a newcomer types: `make demo` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python

.PHONY: demo test venv clean

$(VENV)/.installed: requirements-test.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r requirements-test.txt
	$(VPY) -m pip install -q --no-deps -e .
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VPY) -m fuselens.demo examples

test: venv
	FUSELENS_INTERPRET=1 $(VPY) -m pytest -q -n 2 tests

clean:
	rm -rf $(VENV)
