#!/usr/bin/env bash
# Builds ExecuTorch's Qualcomm LLM runner (`qnn_llama_runner`) from an ExecuTorch source checkout, for this
# machine (x86_64, driving the QNN HTP emulator) or, with --android, for a phone.
#
# It runs the same CMake configuration as ExecuTorch's backends/qualcomm/scripts/build.sh, step by step, and
# not build.sh itself, for two measured reasons: build.sh starts with `pip install -r requirements.txt` into
# whatever Python is first on PATH (here: the project's shared venv), and its x86 branch ends with
# `git submodule update --init` inside extension/llm/tokenizers, which needs the network.
#
# Nothing from Qualcomm or ExecuTorch is copied into this repository: the checkout, the QNN headers and the QNN
# libraries are read where they lie, and the stand-in QNN_SDK_ROOT (symlinks only) is made in the output folder.
#
# Usage:
#   tools/build_qnn_runner.sh --executorch DIR --qnn-include DIR --qnn-libs DIR [--qnn-libs DIR ...] \
#       [--out DIR] [--jobs N] [-- CMAKE_ARG ...]
#   tools/build_qnn_runner.sh --android --executorch DIR --qnn-sdk DIR --ndk DIR [--out DIR] [--jobs N] [-- ...]
#
# x86 (this machine): --qnn-include is a folder holding QnnInterface.h etc. (the QAIRT C headers, e.g.
# external/QNN/include of github.com/chuzcjoe/qnnx); --qnn-libs the folder(s) of the x86 QNN libraries, e.g. the
# onnxruntime_qnn/ and onnxruntime_qnn.libs/ (libc++) folders of the onnxruntime-qnn wheel.
# Android: --qnn-sdk is a real QAIRT SDK root (2.49 or newer), --ndk the Android NDK (r26+). Not run here (no
# SDK, no NDK on this machine): it is the x86 recipe with the NDK's toolchain file, as build.sh does.
#
# Arguments after `--` go to both CMake configurations, e.g. `-- -DCMAKE_BUILD_TYPE=Release
# -DCMAKE_CXX_FLAGS_RELEASE=-O1 -DCMAKE_C_FLAGS_RELEASE=-O1` (what built the runner on a busy 2-core machine: the
# runner's own code is not where its time goes, the QNN library is). PYTHON_EXECUTABLE: a Python with torch.
#
# Prints the binary's path and the environment to run it with.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "build_qnn_runner: $*" >&2; exit 2; }

ET="" QNN_INCLUDE="" QNN_LIBS=() QNN_SDK="" NDK="" OUT="" JOBS=2 ANDROID=false EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --executorch) ET=$2; shift 2;;
    --qnn-include) QNN_INCLUDE=$2; shift 2;;
    --qnn-libs) QNN_LIBS+=("$2"); shift 2;;
    --qnn-sdk) QNN_SDK=$2; shift 2;;
    --ndk) NDK=$2; shift 2;;
    --out) OUT=$2; shift 2;;
    --jobs) JOBS=$2; shift 2;;
    --android) ANDROID=true; shift;;
    -h|--help) usage 0;;
    --) shift; EXTRA=("$@"); break;;
    *) echo "build_qnn_runner: unknown argument '$1'" >&2; usage 2;;
  esac
done

[[ -n $ET ]] || die "--executorch DIR is required (an ExecuTorch source checkout with its submodules)"
ET=$(cd "$ET" && pwd -P)
[[ -f $ET/backends/qualcomm/scripts/build.sh ]] \
  || die "'$ET' is not an ExecuTorch checkout (no backends/qualcomm/scripts/build.sh)"
[[ -f $ET/examples/qualcomm/oss_scripts/llama/qnn_llama_runner.cpp ]] \
  || die "'$ET' has no qnn_llama_runner.cpp: use an ExecuTorch of 2026-08 or newer"
for sub in third-party/flatbuffers third-party/flatcc third-party/gflags extension/llm/tokenizers/third-party/re2 \
           extension/llm/tokenizers/third-party/abseil-cpp extension/llm/tokenizers/third-party/sentencepiece; do
  [[ -f $ET/$sub/CMakeLists.txt ]] || die "'$ET/$sub' is empty: fetch the checkout's submodules first"
done
PYTHON=${PYTHON_EXECUTABLE:-$(command -v python3)}
"$PYTHON" -c "import yaml, torchgen" 2>/dev/null \
  || die "Python '$PYTHON' lacks pyyaml/torchgen (ExecuTorch's kernel codegen needs them): set PYTHON_EXECUTABLE"

if $ANDROID; then
  [[ -d $QNN_SDK/include/QNN && -d $QNN_SDK/lib/aarch64-android ]] \
    || die "--qnn-sdk '$QNN_SDK' is not a QAIRT SDK root (needs include/QNN and lib/aarch64-android)"
  [[ -f $NDK/build/cmake/android.toolchain.cmake ]] \
    || die "--ndk '$NDK' has no build/cmake/android.toolchain.cmake: point it at the Android NDK (r26+)"
  OUT=${OUT:-$ET/build-android}
  SDK_ROOT=$(cd "$QNN_SDK" && pwd -P)
  TOOLCHAIN=(-DCMAKE_TOOLCHAIN_FILE="$NDK/build/cmake/android.toolchain.cmake" -DANDROID_ABI=arm64-v8a
             -DANDROID_PLATFORM=android-30)
else
  [[ -f $QNN_INCLUDE/QnnInterface.h ]] || die "--qnn-include '$QNN_INCLUDE' has no QnnInterface.h"
  [[ ${#QNN_LIBS[@]} -gt 0 ]] || die "--qnn-libs DIR is required (the folder holding libQnnHtp.so for x86_64)"
  OUT=${OUT:-$ET/build-x86}
  mkdir -p "$OUT"
  # ExecuTorch reads $QNN_SDK_ROOT/include/QNN and $QNN_SDK_ROOT/lib/x86_64-linux-clang. Each library is linked
  # one by one (not the folder) so that libQnnHtp.so's RPATH $ORIGIN finds the wheel's libc++ beside it.
  SDK_ROOT=$OUT/qnn_sdk_root
  rm -rf "$SDK_ROOT"; mkdir -p "$SDK_ROOT/include" "$SDK_ROOT/lib/x86_64-linux-clang"
  ln -s "$(cd "$QNN_INCLUDE" && pwd -P)" "$SDK_ROOT/include/QNN"
  for dir in "${QNN_LIBS[@]}"; do
    [[ -d $dir ]] || die "--qnn-libs '$dir' is not a folder"
    for lib in "$(cd "$dir" && pwd -P)"/*.so*; do ln -sf "$lib" "$SDK_ROOT/lib/x86_64-linux-clang/"; done
  done
  [[ -e $SDK_ROOT/lib/x86_64-linux-clang/libQnnHtp.so ]] || die "no libQnnHtp.so in --qnn-libs ${QNN_LIBS[*]}"
  TOOLCHAIN=()
fi
export QNN_SDK_ROOT=$SDK_ROOT
BUILD_TYPE=${BUILD_TYPE:-RelWithDebInfo}
set -x
# Step 1: ExecuTorch with the QNN backend, installed into $OUT (build.sh's flags; the quantized AOT library is
# left out: it links against libtorch and only serves Python).
cmake -S "$ET" -B "$OUT" -G Ninja "${TOOLCHAIN[@]}" \
  -DCMAKE_BUILD_TYPE="$BUILD_TYPE" -DCMAKE_INSTALL_PREFIX="$OUT" -DQNN_SDK_ROOT="$SDK_ROOT" \
  -DEXECUTORCH_BUILD_QNN=ON -DEXECUTORCH_BUILD_DEVTOOLS=ON \
  -DEXECUTORCH_BUILD_EXTENSION_LLM=ON -DEXECUTORCH_BUILD_EXTENSION_LLM_RUNNER=ON \
  -DEXECUTORCH_BUILD_EXTENSION_MODULE=ON -DEXECUTORCH_BUILD_EXTENSION_DATA_LOADER=ON \
  -DEXECUTORCH_BUILD_EXTENSION_FLAT_TENSOR=ON -DEXECUTORCH_BUILD_EXTENSION_NAMED_DATA_MAP=ON \
  -DEXECUTORCH_BUILD_EXTENSION_TENSOR=ON -DEXECUTORCH_BUILD_KERNELS_QUANTIZED=ON \
  -DEXECUTORCH_ENABLE_EVENT_TRACER=ON -DEXECUTORCH_ENABLE_LOGGING=ON -DPYTHON_EXECUTABLE="$PYTHON" "${EXTRA[@]}"
cmake --build "$OUT" -j"$JOBS" --target install
# Step 2: the Qualcomm examples, of which only qnn_llama_runner is built.
EXAMPLES=$OUT/examples/qualcomm
cmake -S "$ET/examples/qualcomm" -B "$EXAMPLES" -G Ninja "${TOOLCHAIN[@]}" \
  -DCMAKE_BUILD_TYPE="$BUILD_TYPE" -DCMAKE_PREFIX_PATH="$OUT;$OUT/third-party/gflags" \
  -DCMAKE_FIND_ROOT_PATH_MODE_PACKAGE=BOTH -DPYTHON_EXECUTABLE="$PYTHON" -DSUPPORT_REGEX_LOOKAHEAD=ON \
  -DBUILD_TESTING=OFF -DEXECUTORCH_ENABLE_LOGGING=ON -DEXECUTORCH_BUILD_KERNELS_QUANTIZED=ON "${EXTRA[@]}"
cmake --build "$EXAMPLES" -j"$JOBS" --target qnn_llama_runner
set +x

RUNNER=$EXAMPLES/oss_scripts/llama/qnn_llama_runner
[[ -x $RUNNER ]] || die "the build finished without $RUNNER"
BACKEND=$(dirname "$(find "$OUT/backends/qualcomm" -name 'libqnn_executorch_backend.so' | head -1)")
echo
echo "qnn_llama_runner: $RUNNER"
if $ANDROID; then
  echo "push it with $BACKEND/libqnn_executorch_backend.so; point QNN_LLAMA_RUNNER at it for --device adb:"
  echo "  export QNN_LLAMA_RUNNER=$RUNNER QNN_SDK_ROOT=$SDK_ROOT"
else
  echo "run it (and the tests that need it) with:"
  echo "  export QNN_LLAMA_RUNNER=$RUNNER"
  echo "  export LD_LIBRARY_PATH=$SDK_ROOT/lib/x86_64-linux-clang:$OUT/lib:$BACKEND"
fi
