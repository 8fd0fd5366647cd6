# The two commands a newcomer types: `make demo` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python

.PHONY: demo test test-gpu test-python test-e2e conformance vsix venv clean

$(VENV)/.installed: requirements-test.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r requirements-test.txt
	$(VPY) -m pip install -q --no-deps -e .
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VPY) -m fuselens.demo examples

# The whole suite: compiler and server tests (generated kernels run in Triton's interpreter),
# then the extension end to end in a real VS Code (installs code-server/Chromium on first use).
test: test-python test-e2e

# tests/conformance, PyTorch's OpInfo database on the first sample of each op, variant and dtype,
# runs on its own so that its summary line is printed (its conftest is loaded by the controller).
# Then the backend tests of what kernels compute and the conformance, again through the CPU's C++
# kernels (FUSELENS_CPU_BACKEND=cpp; tests of the Triton kernels' own structure skip themselves there).
CPP_TESTS := $(addprefix tests/backend/,test_cpp_kernels.py test_ops.py test_dtype_semantics.py \
	test_interpreter_math.py test_autograd_semantics.py test_autograd.py test_batch_norm.py test_indexing.py \
	test_random_programs.py test_conv_blocks.py test_attention.py test_shape_errors.py test_constants.py \
	test_reinplace.py test_decode.py test_long_rows.py test_in_place.py test_activations.py)
test-python: venv
	FUSELENS_INTERPRET=1 TRITON_INTERPRET=1 $(VPY) -m pytest -q -n 2 tests --ignore=tests/conformance
	FUSELENS_INTERPRET=1 TRITON_INTERPRET=1 $(VPY) -m pytest -q -n 2 tests/conformance
	FUSELENS_INTERPRET=1 TRITON_INTERPRET=1 FUSELENS_CPU_BACKEND=cpp $(VPY) -m pytest -q -n 2 $(CPP_TESTS)
	FUSELENS_INTERPRET=1 TRITON_INTERPRET=1 FUSELENS_CPU_BACKEND=cpp $(VPY) -m pytest -q -n 2 tests/conformance

# The OpInfo database through fuselens on every sample (not only the first); one summary line.
conformance: venv
	FUSELENS_INTERPRET=1 TRITON_INTERPRET=1 FUSELENS_OPINFO=full $(VPY) -m pytest -q -n 2 tests/conformance

# The suite on a CUDA GPU with real Triton kernels, run with the machine's own Python (no venv is
# made there: PY=python3 must hold torch with CUDA, triton, pytest-xdist, transformers, expecttest)
test-gpu:
	PY=$(PY) bash scripts/test-gpu.sh

test-e2e: venv
	bash scripts/e2e.sh

vsix:
	npm install --no-audit --no-fund
	npm run vsix

clean:
	rm -rf $(VENV)
