#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench and llama-batched-bench for benchmarking Relay against it.
#
# llama.cpp's code is NOT part of this repository (and must never be committed): this script downloads the
# llama-cpp-python source release from PyPI at run time, extracts the llama.cpp copy it vendors, and builds
# into .bench/ (an ignored folder):
#   .bench/llama-cpp-python-<ver>/vendor/llama.cpp   the sources
#   .bench/llama.cpp-build/bin/llama-server          the binaries
#
#   scripts/build_llama_cpp.sh            build (skips when the three binaries already exist)
#   scripts/build_llama_cpp.sh --force    rebuild
# Environment: PYTHON (default python3), JOBS (default: number of cores), LLAMA_CPP_PYTHON_VERSION (pin the
# sdist version, default: the newest on PyPI).
# Needs: a C/C++ compiler, cmake >= 3.14 and ninja (installed from PyPI with pip when missing), ~6 minutes
# with 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BENCH="$ROOT/.bench"
BUILD="$BENCH/llama.cpp-build"
PY=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
TARGETS=(llama-server llama-bench llama-batched-bench)

force=0
[ "${1:-}" = "--force" ] && force=1

built=1
for t in "${TARGETS[@]}"; do [ -x "$BUILD/bin/$t" ] || built=0; done
if [ $built = 1 ] && [ $force = 0 ]; then
  echo "llama.cpp already built in $BUILD/bin (use --force to rebuild)"
  exit 0
fi

mkdir -p "$BENCH"

# Tools: cmake and ninja from PyPI when the system has none.
for tool in cmake ninja; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "installing $tool from PyPI"
    $PY -m pip install --quiet "$tool"
  fi
done
command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || { echo "no C compiler (apt-get install build-essential)" >&2; exit 1; }
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || { echo "no C++ compiler (apt-get install build-essential)" >&2; exit 1; }

# Sources: the llama-cpp-python sdist, downloaded once.
SRC=$(ls -d "$BENCH"/llama-cpp-python-*/vendor/llama.cpp 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$SRC" ] || [ ! -f "$SRC/CMakeLists.txt" ]; then
  spec="llama-cpp-python"
  [ -n "${LLAMA_CPP_PYTHON_VERSION:-}" ] && spec="llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
  mkdir -p "$BENCH/sdist"
  tarball=$(ls "$BENCH"/sdist/llama_cpp_python-*.tar.gz "$BENCH"/sdist/llama-cpp-python-*.tar.gz 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -z "$tarball" ] || [ -n "${LLAMA_CPP_PYTHON_VERSION:-}" ]; then
    echo "downloading the $spec source release from PyPI"
    # (pip prepares the sdist's metadata in an isolated environment: it fetches scikit-build-core for that.)
    $PY -m pip download --quiet --no-binary :all: --no-deps -d "$BENCH/sdist" "$spec"
    tarball=$(ls "$BENCH"/sdist/llama_cpp_python-*.tar.gz "$BENCH"/sdist/llama-cpp-python-*.tar.gz 2>/dev/null | sort -V | tail -n 1 || true)
  fi
  [ -n "$tarball" ] || { echo "no sdist downloaded into $BENCH/sdist" >&2; exit 1; }
  echo "extracting $tarball"
  tar -xzf "$tarball" -C "$BENCH"
  # The archive's top folder is llama_cpp_python-<ver> (newer releases) or llama-cpp-python-<ver>.
  base=$(basename "$tarball" .tar.gz)
  top=${base/llama_cpp_python/llama-cpp-python}
  if [ "$top" != "$base" ] && [ -d "$BENCH/$base" ]; then
    rm -rf "${BENCH:?}/$top"
    mv "$BENCH/$base" "$BENCH/$top"
  fi
  SRC="$BENCH/$top/vendor/llama.cpp"
fi
[ -f "$SRC/CMakeLists.txt" ] || { echo "no llama.cpp sources in $SRC" >&2; exit 1; }
echo "llama.cpp sources: $SRC"

cmake -S "$SRC" -B "$BUILD" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=ON \
  -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_BUILD_SERVER=ON \
  -DBUILD_SHARED_LIBS=OFF
cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}"

for t in "${TARGETS[@]}"; do
  [ -x "$BUILD/bin/$t" ] || { echo "missing $BUILD/bin/$t after the build" >&2; exit 1; }
done
"$BUILD/bin/llama-server" --version 2>&1 | head -n 3 || true
echo "built: $BUILD/bin/{$(IFS=,; echo "${TARGETS[*]}")}"
