#!/bin/bash
# A compiler and linker launcher that appends "wall user sys output" (seconds)
# of each command to $CPULOG: the CPU-seconds per object file of a build on
# a shared machine, where wall times say little (docs/testing.md).
# cmake ... -DCMAKE_CXX_COMPILER_LAUNCHER=$PWD/bench/build_time/cpulaunch.sh
#   -DCMAKE_CUDA_COMPILER_LAUNCHER=... -DCMAKE_CXX_LINKER_LAUNCHER=...
o=""; prev=""
for a in "$@"; do if [ "$prev" = "-o" ]; then o="$a"; fi; prev="$a"; done
exec /usr/bin/time -f "%e %U %S $o" -a -o "${CPULOG:-/tmp/cpulog.txt}" "$@"
