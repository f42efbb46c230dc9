#!/usr/bin/env bash
# Run on the CPU machine before sending the tree to a GPU machine (no internet there, no cffi,
# no liburing): makes the two ignored folders that travel with it. Idempotent.
#   .whl/       cp312 manylinux x86-64 wheels of what infinity needs that the GPU image lacks
#   .gpu_libs/  liburing's headers and static library (Debian's liburing-dev), so native/aio
#               builds with io_uring and the built module needs no liburing.so at run time
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS="cffi==2.0.0 pycparser==3.0 tqdm==4.70.1"

mkdir -p .whl
for spec in $WHEELS; do
  name=${spec%%==*}; version=${spec##*==}
  ls .whl/"$name"-"$version"-*.whl >/dev/null 2>&1 && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec"
done

if ! [ -e .gpu_libs/lib/liburing.a ] || ! [ -e .gpu_libs/include/liburing.h ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download -qq liburing-dev >/dev/null 2>&1 && dpkg -x liburing-dev_*.deb root)
  rm -rf .gpu_libs && mkdir -p .gpu_libs/lib
  cp -r "$tmp"/root/usr/include .gpu_libs/include
  cp "$tmp"/root/usr/lib/x86_64-linux-gnu/liburing.a .gpu_libs/lib/
  rm -rf "$tmp"
fi

for d in .whl/ .gpu_libs/; do
  grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
du -sh .whl .gpu_libs
ls .whl
