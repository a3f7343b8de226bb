#!/usr/bin/env bash
# Install Nsight Systems into a private prefix without the NVIDIA driver stack, and print the nsys path.
#
# Uses an nsys already on PATH (or $NSYS) when there is one. Otherwise downloads Debian's nsight-systems
# (non-free) .debs with apt-get (a private apt state with non-free enabled; the system's sources are
# untouched), unpacks them into $RLPROF_NSYS_PREFIX (default .nsys/) and adds the host-linux-x64 link
# without which only a .qdstrm is written. Idempotent. Exit 3 when nsys cannot be installed here.
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX=$(realpath -m "${RLPROF_NSYS_PREFIX:-.nsys}")

found=${NSYS:-$(command -v nsys || true)}
if [ -n "$found" ] && [ -x "$found" ]; then echo "$found"; exit 0; fi
if [ -x "$PREFIX/nsys" ] && "$PREFIX/nsys" --version >/dev/null 2>&1; then echo "$PREFIX/nsys"; exit 0; fi

command -v apt-get >/dev/null && command -v dpkg >/dev/null || { echo "install_nsys.sh: needs apt-get and dpkg (Debian/Ubuntu)" >&2; exit 3; }
. /etc/os-release
state=$(mktemp -d); trap 'rm -rf "$state"' EXIT
mkdir -p "$state/lists/partial" "$state/archives/partial" "$state/debs"
echo "deb http://deb.debian.org/debian ${VERSION_CODENAME:-bookworm} main non-free" > "$state/sources.list"
opts=(-o "Dir::Etc::SourceList=$state/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
      -o "Dir::State::Lists=$state/lists" -o "Dir::Cache::Archives=$state/archives" -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root")
apt-get "${opts[@]}" -qq update >&2 || { echo "install_nsys.sh: apt-get update of Debian non-free failed" >&2; exit 3; }
(cd "$state/debs" && apt-get "${opts[@]}" -qq download nsight-systems nsight-systems-target libssh-4 >&2) \
  || { echo "install_nsys.sh: could not download nsight-systems from Debian non-free" >&2; exit 3; }
mkdir -p "$PREFIX"
for deb in "$state"/debs/*.deb; do dpkg -x "$deb" "$PREFIX"; done
# nsys looks for its host tools beside the target dir; Debian splits them across two lib folders.
ln -sfn ../../nsight-systems/host-linux-x64 "$PREFIX/usr/lib/x86_64-linux-gnu/nsight-systems/host-linux-x64"
# The launcher is the target-side nsys; Debian's libssh-4 lands in the prefix, not on the loader path.
bin=$(find "$PREFIX/usr" -type f -name nsys -perm -u+x | head -1)
[ -n "$bin" ] || { echo "install_nsys.sh: no nsys binary in the unpacked packages" >&2; exit 3; }
cat > "$PREFIX/nsys" <<WRAP
#!/bin/sh
export LD_LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$bin" "\$@"
WRAP
chmod +x "$PREFIX/nsys"
"$PREFIX/nsys" --version >&2 || { echo "install_nsys.sh: unpacked nsys does not run" >&2; exit 3; }
echo "$PREFIX/nsys"
