#!/usr/bin/env bash
# Make Debian's headless Chromium available (the HTML tests open pages in it with the network off) and print its path.
# Idempotent; exit 3 when it cannot be installed here (no apt-get, not root).
set -euo pipefail
found=$(command -v chromium || command -v chromium-browser || true)
if [ -n "$found" ]; then echo "$found"; exit 0; fi
command -v apt-get >/dev/null || { echo "install_chromium.sh: needs apt-get (Debian/Ubuntu)" >&2; exit 3; }
[ "$(id -u)" = 0 ] || { echo "install_chromium.sh: run as root to apt-get install chromium" >&2; exit 3; }
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq chromium >/dev/null
command -v chromium
