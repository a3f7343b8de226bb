#!/usr/bin/env bash
# Make Debian's Prometheus server and promtool available (the live-monitoring tests scrape real runs with it) and
# print the server's path. Idempotent; exit 3 when it cannot be installed here (no apt-get, not root). The package's
# service is not started: the tests start their own server on the loopback.
set -euo pipefail
found=$(command -v prometheus || true)
if [ -n "$found" ] && command -v promtool >/dev/null; then echo "$found"; exit 0; fi
command -v apt-get >/dev/null || { echo "install_prometheus.sh: needs apt-get (Debian/Ubuntu)" >&2; exit 3; }
[ "$(id -u)" = 0 ] || { echo "install_prometheus.sh: run as root to apt-get install prometheus" >&2; exit 3; }
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v prometheus
