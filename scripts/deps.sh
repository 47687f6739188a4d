#!/usr/bin/env bash
# Installs what latentkv builds with, from Debian's packages, where something is missing:
# cmake, ninja, g++, GoogleTest, CLI11, nlohmann-json, toml++, and matplotlib for `latentkv step --plot`
# (the CUDA toolkit is optional).
#
#   scripts/deps.sh           install what is missing (needs root and apt-get)
#   scripts/deps.sh --carry   also copy the header-only libraries and GoogleTest's sources into
#                             .deps/ (git-ignored), for a machine without a package registry
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(cmake ninja-build g++ libgtest-dev googletest libcli11-dev nlohmann-json3-dev libtomlplusplus-dev
          python3-matplotlib)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "missing packages: ${missing[*]} (install them, or run this as root on Debian/Ubuntu)" >&2
    exit 1
  fi
  echo "installing: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if [ "${1:-}" = "--carry" ]; then
  mkdir -p .deps/include
  cp -r /usr/include/CLI /usr/include/nlohmann /usr/include/toml++ .deps/include/
  rm -rf .deps/googletest && cp -r /usr/src/googletest .deps/googletest
  echo "header-only dependencies copied to .deps/"
fi
