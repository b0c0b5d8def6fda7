#!/bin/sh
# Checks that a binary's shared libraries all resolve, as the dynamic loader
# would resolve them in this image (ldd: RUNPATH, LD_LIBRARY_PATH,
# ld.so.cache), and optionally where some of them come from.
#
#   ldd-check.sh BINARY [LIBRARY=DIR ...]
#
# Exit 0 when every library ldd lists resolves and each LIBRARY (a file name
# prefix, e.g. libtorch_cuda.so) is loaded from DIR; exit 1 naming each
# library that is "not found" or comes from elsewhere; exit 2 on bad usage.
# libcuda.so.1 (the driver) may be missing: the NVIDIA container runtime
# mounts the host's at run time, so no image contains it.
#
# Used by deploy/docker/Dockerfile.cuda in its runtime stage; tested by
# tests/deploy/deploy_test.py (DockerfileTest).
set -u

if [ $# -lt 1 ] || [ ! -f "$1" ]; then
  echo "usage: ldd-check.sh BINARY [LIBRARY=DIR ...]" >&2
  exit 2
fi
binary=$1
shift

if ! out=$(ldd "$binary" 2>&1); then
  echo "ldd-check: ldd $binary failed: $out" >&2
  exit 1
fi

status=0
missing=$(printf '%s\n' "$out" | grep 'not found' | grep -v '^[[:space:]]*libcuda\.so\.1 ')
if [ -n "$missing" ]; then
  echo "ldd-check: $binary: libraries not found:" >&2
  printf '%s\n' "$missing" >&2
  status=1
fi

for want in "$@"; do
  lib=${want%%=*}
  dir=${want#*=}
  if [ -z "$lib" ] || [ "$lib" = "$want" ] || [ -z "$dir" ]; then
    echo "ldd-check: expected LIBRARY=DIR, got '$want'" >&2
    exit 2
  fi
  path=$(printf '%s\n' "$out" | awk -v lib="$lib" \
    'index($1, lib) == 1 && $2 == "=>" { print $3; exit }')
  if [ -z "$path" ]; then
    echo "ldd-check: $binary does not load $lib" >&2
    status=1
  elif [ "$(dirname "$path")" != "${dir%/}" ]; then
    echo "ldd-check: $binary loads $lib from $path, not from $dir" >&2
    status=1
  fi
done

[ $status -eq 0 ] && echo "ldd-check: $binary: every library resolves"
exit $status
