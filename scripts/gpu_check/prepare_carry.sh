#!/usr/bin/env bash
# Run on the CPU machine before sending the tree to a GPU machine (no internet there, no cffi,
# no liburing, no DeepSpeed, no libaio): makes the two ignored folders that travel with it.
# Idempotent.
#   .whl/       cp312 manylinux x86-64 wheels of what infinity needs that the GPU image lacks, and
#               DeepSpeed (a py3 wheel built here from its sdist, no ops: they are JIT-built on the
#               GPU machine) with the dependencies the image lacks; exactly one version of each
#   .gpu_libs/  liburing's headers and static library (Debian's liburing-dev), so native/aio
#               builds with io_uring and the built module needs no liburing.so at run time;
#               libaio/ (Debian's libaio1 and libaio-dev: include/ and lib/ with the .so and its
#               links), which DeepSpeed's async_io op (its NVMe offload) compiles and links against
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS="cffi==2.0.0 pycparser==3.0 tqdm==4.70.1"
DEEPSPEED=0.19.8
DEEPSPEED_WHEELS="hjson==3.1.0 einops==0.8.2 msgpack==1.2.4 pydantic==2.13.4 pydantic-core==2.46.4
                  annotated-types==0.7.0 typing-inspection==0.4.2 typing-extensions==4.16.0"

wheel_name() { echo "$1" | tr '-' '_'; }  # a wheel's file name spells its project with underscores

mkdir -p .whl
for spec in $WHEELS $DEEPSPEED_WHEELS; do
  name=$(wheel_name "${spec%%==*}"); version=${spec##*==}
  ls .whl/"$name"-"$version"-*.whl >/dev/null 2>&1 && continue
  rm -f .whl/"$name"-*.whl  # another version: one of each
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec"
done

# DeepSpeed: its sdist built into a py3 wheel with no ops (DS_BUILD_OPS=0); its setup.py imports
# torch, hence no build isolation (torch is installed here).
if ! ls .whl/deepspeed-"$DEEPSPEED"-*.whl >/dev/null 2>&1; then
  rm -f .whl/deepspeed-*.whl
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "deepspeed==$DEEPSPEED"
  DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w "$tmp/wheel" "$tmp"/deepspeed-*.tar.gz
  cp "$tmp"/wheel/deepspeed-"$DEEPSPEED"-*.whl .whl/
  rm -rf "$tmp"
fi

# Debian packages unpacked: apt-get download needs no root, dpkg -x no install.
unpack_debs() {  # destination, packages...
  local dest=$1; shift
  (cd "$tmp" && apt-get download -qq "$@" >/dev/null 2>&1 && for deb in *.deb; do dpkg -x "$deb" "$dest"; done)
}
if ! [ -e .gpu_libs/lib/liburing.a ] || ! [ -e .gpu_libs/include/liburing.h ]; then
  tmp=$(mktemp -d)
  unpack_debs root liburing-dev
  rm -rf .gpu_libs/lib .gpu_libs/include && mkdir -p .gpu_libs/lib
  cp -r "$tmp"/root/usr/include .gpu_libs/include
  cp "$tmp"/root/usr/lib/x86_64-linux-gnu/liburing.a .gpu_libs/lib/
  rm -rf "$tmp"
fi
if ! [ -e .gpu_libs/libaio/include/libaio.h ] || ! [ -e .gpu_libs/libaio/lib/libaio.so ]; then
  tmp=$(mktemp -d)
  aio=libaio1t64
  apt-cache show libaio1t64 >/dev/null 2>&1 || aio=libaio1  # renamed after bookworm
  unpack_debs root "$aio" libaio-dev
  rm -rf .gpu_libs/libaio && mkdir -p .gpu_libs/libaio/include .gpu_libs/libaio/lib
  cp "$tmp"/root/usr/include/libaio.h .gpu_libs/libaio/include/
  cp -P "$tmp"/root/usr/lib/x86_64-linux-gnu/libaio.so* .gpu_libs/libaio/lib/  # -P: the links stay links
  rm -rf "$tmp"
fi

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for d in .whl/ .gpu_libs/; do
  grep -qxF "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"
done
du -sh .whl .gpu_libs
total=$(du -sk .whl .gpu_libs | awk '{s += $1} END {print s}')
if [ "$total" -gt $((40 * 1024)) ]; then
  echo "the carried folders hold $((total / 1024)) MiB; the tree that travels is limited to 64 MiB" >&2
  exit 1
fi
ls .whl .gpu_libs/libaio/lib
