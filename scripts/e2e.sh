#!/bin/bash
# Extension end to end in a real VS Code: code-server + headless Chromium, driven by
# playwright-core (tests/extension/e2e.js). Installs what it needs first (idempotent, cached in
# scripts/.cache/), builds the .vsix, installs it into a fresh code-server profile, opens a copy
# of tests/extension/workspace/, and runs the steps; screenshots go to test-output/e2e/.
#   FUSELENS_E2E_PYTHON   interpreter for the language server (default: .venv/bin/python); the
#                         workspace gets it as its own .venv, and no fuselens setting names it
#   FUSELENS_E2E_README=1 also writes docs/images/editor.png (the README screenshot)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
T0=$(date +%s)
bash scripts/e2e-install.sh
CS="$ROOT/scripts/.cache/code-server/node_modules/.bin/code-server"
PY=${FUSELENS_E2E_PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
# step 08 opens the installed transformers' modeling_gpt2.py (workspace/train_gpt2.py compiles its
# GPT2ForSequenceClassification) and checks every warning lies in that class's forward: its lines
GPT2=$("$PY" -c '
import ast, os, transformers
f = os.path.realpath(os.path.join(os.path.dirname(transformers.__file__), "models", "gpt2", "modeling_gpt2.py"))
cls = next(n for n in ast.parse(open(f).read()).body if isinstance(n, ast.ClassDef) and n.name == "GPT2ForSequenceClassification")
fwd = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
print(f, f"{fwd.lineno}-{fwd.end_lineno}")') || { echo "[e2e] $PY cannot import transformers (requirements-test.txt)"; exit 1; }
export FUSELENS_E2E_GPT2_FILE=${GPT2% *} FUSELENS_E2E_GPT2_FORWARD=${GPT2##* }

echo "[e2e] building the .vsix"
npm run --silent vsix >/dev/null

OUT="$ROOT/test-output/e2e"
rm -rf "$OUT" && mkdir -p "$OUT"
RUN=$(mktemp -d /tmp/fuselens-e2e.XXXXXX)
mkdir -p "$RUN/data/User" "$RUN/exts" "$RUN/xdg/config" "$RUN/xdg/data" "$RUN/xdg/cache" "$RUN/ws"
cp -r tests/extension/workspace/. "$RUN/ws/"
# a fresh workspace with a .venv and no settings: the extension must find the interpreter itself
mkdir -p "$RUN/ws/.venv/bin"
printf '#!/bin/sh\nexec "%s" "$@"\n' "$PY" > "$RUN/ws/.venv/bin/python" && chmod +x "$RUN/ws/.venv/bin/python"
# a second workspace whose .venv lacks torch (and pygls...): the extension must say so. Its
# python is a stand-in, to test the Install button offline: python3 without site-packages, whose
# `-m pip install ...` records its arguments (in .venv/pip-args) and makes it $PY from then on
NT="$RUN/ws-notorch/.venv"
mkdir -p "$NT/bin" && cp tests/extension/workspace/showcase.py "$RUN/ws-notorch/"
cat > "$NT/bin/python" <<SH
#!/bin/sh
if [ "\$1 \$2 \$3" = "-m pip install" ]; then
  echo "\$@" > "$NT/pip-args"; touch "$NT/installed"; echo "Successfully installed (stand-in pip)"; exit 0
fi
[ -f "$NT/installed" ] && exec "$PY" "\$@"
exec "$(command -v python3)" -S "\$@"
SH
chmod +x "$NT/bin/python"
cat > "$RUN/data/User/settings.json" <<JSON
{
  "workbench.startupEditor": "none",
  "telemetry.telemetryLevel": "off",
  "update.mode": "none",
  "extensions.autoCheckUpdates": false,
  "extensions.autoUpdate": false,
  "workbench.tips.enabled": false,
  "editor.hover.delay": 200,
  "editor.quickSuggestions": { "other": false, "comments": false, "strings": false },
  "editor.acceptSuggestionOnEnter": "off",
  "window.commandCenter": false,
  "chat.commandCenter.enabled": false,
  "workbench.secondarySideBar.defaultVisibility": "hidden",
  "git.openRepositoryInParentFolders": "never",
  "fuselens.worker.timeLimitSeconds": 240
}
JSON
export XDG_CONFIG_HOME="$RUN/xdg/config" XDG_DATA_HOME="$RUN/xdg/data" XDG_CACHE_HOME="$RUN/xdg/cache"
"$CS" --user-data-dir "$RUN/data" --extensions-dir "$RUN/exts" --install-extension "$ROOT/fuselens.vsix" >"$OUT/install.log" 2>&1

PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
setsid "$CS" --bind-addr "127.0.0.1:$PORT" --auth none --disable-telemetry --disable-update-check \
  --disable-workspace-trust --user-data-dir "$RUN/data" --extensions-dir "$RUN/exts" >"$OUT/code-server.log" 2>&1 &
CSPID=$!
cleanup() {
  kill -- -"$CSPID" 2>/dev/null || true
  sleep 0.5
  kill -9 -- -"$CSPID" 2>/dev/null || true
  cp -r "$RUN/data/logs" "$OUT/vscode-logs" 2>/dev/null || true
  rm -rf "$RUN"
}
trap cleanup EXIT
for _ in $(seq 1 100); do
  python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/healthz', timeout=1)" >/dev/null 2>&1 && break
  sleep 0.2
done
echo "[e2e] code-server up on port $PORT; driving the workbench"
set +e
FUSELENS_E2E_CS_PID=$CSPID FUSELENS_E2E_PYTHON=$PY node tests/extension/e2e.js "http://127.0.0.1:$PORT/?folder=$RUN/ws" "$OUT" "http://127.0.0.1:$PORT/?folder=$RUN/ws-notorch" 2>&1 | tee "$OUT/driver.log"
RC=${PIPESTATUS[0]}
set -e
if [ "$RC" != 0 ]; then
  # CI keeps only what is printed: the extension's log (server start, stops, errors) tells most
  for f in $(find "$RUN/data/logs" -name fuselens.log 2>/dev/null); do echo "[e2e] tail of $f:"; tail -n 40 "$f"; done
fi
if [ "$RC" = 0 ] && [ "${FUSELENS_E2E_README:-0}" = 1 ] && [ -f "$OUT/readme-editor.png" ]; then
  mkdir -p docs/images && cp "$OUT/readme-editor.png" docs/images/editor.png
fi
echo "[e2e] $( [ "$RC" = 0 ] && echo PASSED || echo FAILED ) in $(( $(date +%s) - T0 )) s; screenshots in test-output/e2e/"
exit "$RC"
