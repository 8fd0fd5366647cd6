#!/bin/bash
# The suite on a CUDA GPU with kernels compiled by real Triton (FUSELENS_INTERPRET=0): the
# compiler, backend and model tests, then PyTorch's OpInfo database on CUDA. Run on the GPU
# machine with its own Python (PY=python3 by default), which must hold torch with CUDA, triton,
# pytest, pytest-xdist, transformers and expecttest; nothing is installed. The pytest summary
# lines (failures listed) go to test-output/gpu-tests.txt, which a GPU run commits as
# bench/results/gpu-tests-<gpu>.txt; each test's outcome and time go to test-output/gpu-NAME.outcomes
# as it ends (named even when a time limit stops the run before pytest's summary).
#   scripts/test-gpu.sh [PYTEST_PATH ...]   only these tests (default: the whole GPU suite)
#   FUSELENS_GPU_WORKERS=N                  pytest-xdist workers (default: CPU cores - 2)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PY:-python3}
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "test-gpu: torch.cuda.is_available() is False: run it on a machine with a CUDA GPU")' || exit 1
export FUSELENS_INTERPRET=0 TRITON_INTERPRET=0 PYTHONPATH="$ROOT/compiler:$ROOT/server${PYTHONPATH:+:$PYTHONPATH}"
WORKERS=${FUSELENS_GPU_WORKERS:-$(( $(nproc) > 4 ? $(nproc) - 2 : 2 ))}
OUT="$ROOT/test-output"
mkdir -p "$OUT"
SUMMARY="$OUT/gpu-tests.txt"
{
  echo "# make test-gpu: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  "$PY" -c 'import torch, triton, sys; print(f"# {torch.cuda.get_device_name()}, Python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}")'
} > "$SUMMARY"
status=0
run() {  # run NAME PATH...: one pytest session; its summary lines appended to $SUMMARY
  local name=$1; shift
  echo "[test-gpu] $name: $*"
  rm -f "$OUT/gpu-$name.outcomes"
  FUSELENS_TEST_LOG="$OUT/gpu-$name.outcomes" "$PY" -m pytest -q -n "$WORKERS" -p no:cacheprovider -rfEs --durations=15 "$@" 2>&1 | tee "$OUT/gpu-$name.log"
  local rc=${PIPESTATUS[0]}
  { echo; echo "## $name ($*): exit $rc"
    # pytest's short summary (failures, errors, skips with their reasons), the OpInfo summary
    # line and pytest's closing line
    grep -E '^(FAILED|ERROR|SKIPPED|XFAIL|fuselens OpInfo conformance:)|^=* ?[0-9]+ (passed|failed)' "$OUT/gpu-$name.log"
    # why each failed: the first error lines of its traceback (the device's log does not come back)
    awk '/^___+ .* ___+$/ { name = $0; gsub(/^_+ | _+$/, "", name); n = 0 }
         /^E / && name != "" { if (n < 4) print "  " name ": " substr($0, 1, 300); n++ }' "$OUT/gpu-$name.log" ; } >> "$SUMMARY"
  [ "$rc" -eq 0 ] || status=1
}
if [ $# -gt 0 ]; then
  run selected "$@"
else
  run suite tests/backend tests/compiler tests/models
  run conformance tests/conformance
fi
echo "[test-gpu] summary: $SUMMARY"
cat "$SUMMARY"
exit $status
