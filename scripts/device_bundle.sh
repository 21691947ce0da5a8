#!/usr/bin/env bash
# Packs binaries built here (Debian 12) for a machine that lacks their
# libraries (the lent GPU machine: Ubuntu 24.04, CUDA 13 driver): copies each
# binary into DIR and every shared library it needs into DIR/lib, except
# glibc's own (libc, libm, libpthread, libdl, librt, the loader) and the CUDA
# driver (libcuda), which that machine has and must supply itself; strips
# them all and packs DIR into DIR.tar.xz (a tandem + test bundle is ~25 MB,
# within the 64 MiB a device call carries). There:
#   mkdir -p /tmp/b && tar xJf DIR.tar.xz -C /tmp/b && LD_LIBRARY_PATH=/tmp/b/lib /tmp/b/BINARY
#
# Usage: scripts/device_bundle.sh DIR BINARY...
set -euo pipefail
dir=${1:?usage: device_bundle.sh DIR BINARY...}
shift
mkdir -p "$dir/lib"
for bin in "$@"; do
  cp -f "$bin" "$dir/"
  ldd "$bin" | awk '/=> \// {print $3}' | while read -r lib; do
    case $(basename "$lib") in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libcuda.so*|libgcc_s.so*) ;;
      *) [[ -e $dir/lib/$(basename "$lib") ]] || cp -L "$lib" "$dir/lib/" ;;
    esac
  done
done
strip --strip-unneeded "$dir"/lib/* "$dir"/* 2>/dev/null || true
XZ_OPT="-T0 -6" tar cJf "$dir.tar.xz" -C "$dir" .
du -sh "$dir.tar.xz" | awk '{print "device_bundle: " $1 " in " $2}'
