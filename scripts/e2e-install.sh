#!/bin/bash
# Idempotently installs what the extension e2e test needs, cached under scripts/.cache/:
#   - Debian packages: chromium, ripgrep, a C toolchain for code-server's native modules
#   - code-server 4.100.3 (= VS Code 1.100.3; the newest that installs on Node 20)
#   - the repo's npm deps (typescript, esbuild, vscode-languageclient, vsce, playwright-core)
# Safe to run again: each step is skipped when its result is already there.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE="$ROOT/scripts/.cache"
CSV=${CSV:-4.100.3}
CS="$CACHE/code-server"
mkdir -p "$CACHE"
log() { echo "[e2e-install] $*"; }

need_apt=()
command -v chromium >/dev/null || need_apt+=(chromium)
command -v rg >/dev/null || need_apt+=(ripgrep)
command -v make >/dev/null && command -v g++ >/dev/null || need_apt+=(build-essential)
[ -e /usr/include/krb5.h ] || [ -e /usr/include/krb5/krb5.h ] || need_apt+=(libkrb5-dev)
[ -e /usr/include/libsecret-1/libsecret/secret.h ] || need_apt+=(libsecret-1-dev pkg-config)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" python3
fi

if [ ! -d "$ROOT/node_modules/vscode-languageclient" ] || [ ! -d "$ROOT/node_modules/playwright-core" ] \
   || [ "$ROOT/package.json" -nt "$ROOT/node_modules/.fuselens-installed" ]; then
  log "npm install (repo deps)"
  (cd "$ROOT" && npm install --no-audit --no-fund && touch node_modules/.fuselens-installed)
fi

if [ ! -f "$CS/.installed-$CSV" ]; then
  log "installing code-server $CSV into $CS (about 2 minutes, once)"
  rm -rf "$CS" && mkdir -p "$CS" && cd "$CS"
  echo '{"private":true}' > package.json
  export npm_config_yes=true npm_config_unsafe_perm=true
  npm install --no-audit --no-fund --ignore-scripts "code-server@$CSV"
  npm rebuild argon2
  cd node_modules/code-server/lib/vscode
  npm install --no-audit --no-fund --omit=dev --ignore-scripts
  mkdir -p node_modules/@vscode/ripgrep/bin && ln -sf "$(command -v rg)" node_modules/@vscode/ripgrep/bin/rg
  npm rebuild --foreground-scripts
  ln -sfn node_modules node_modules.asar
  (cd bin/remote-cli && ln -sf code-linux.sh code-server)
  (cd bin/helpers && ln -sf browser-linux.sh browser.sh)
  (cd extensions && npm install --no-audit --no-fund --omit=dev)
  touch "$CS/.installed-$CSV"
fi
log "ready: $CS/node_modules/.bin/code-server"
