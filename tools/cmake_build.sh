#!/usr/bin/env bash
# Configure and build mla_ext._C with CMake + find_package(Torch).
#   tools/cmake_build.sh BUILD_DIR [extra cmake args...]
# Uses the venv's python (PYTHON env var overrides) and, when a CUDA toolkit is
# found, passes the paths torch's CMake config needs on these machines.
# cmake and ninja: $CMAKE / $NINJA if set, else the pip packages installed for
# that python (requirements.txt pins cmake 4.x), else the ones next to it, else
# PATH (the system cmake is 3.25 on the build and GPU machines). Exits 77 (the
# "skipped" convention) when the cmake found is older than CMakeLists.txt needs.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:?usage: cmake_build.sh BUILD_DIR}"; shift || true
py="${PYTHON:-$here/.venv/bin/python}"
# tool NAME: the pip package's binary (module attribute BIN_ATTR), next to $py, PATH.
tool() {
  local name="$1" attr="$2" cand
  cand="$("$py" -c "import os, $name; print(os.path.join($name.$attr, '$name'))" 2>/dev/null || true)"
  if [ -n "$cand" ] && [ -x "$cand" ]; then echo "$cand"; return; fi
  cand="$(dirname "$py")/$name"
  if [ -x "$cand" ]; then echo "$cand"; return; fi
  command -v "$name" || true
}
cmake_bin="${CMAKE:-$(tool cmake CMAKE_BIN_DIR)}"
ninja_bin="${NINJA:-$(tool ninja BIN_DIR)}"
[ -n "$cmake_bin" ] || { echo "[mla_ext cmake] SKIP: no cmake found (pip install cmake)"; exit 77; }
[ -n "$ninja_bin" ] || { echo "[mla_ext cmake] SKIP: no ninja found (pip install ninja)"; exit 77; }
cmake_ver="$("$cmake_bin" --version | head -1 | awk '{print $3}')"
IFS=. read -r cmake_major cmake_minor _ <<<"$cmake_ver"
cmake_num=$(( ${cmake_major:-0} * 100 + ${cmake_minor%%[!0-9]*} + 0 ))
echo "[mla_ext cmake] cmake $cmake_ver ($cmake_bin), ninja $ninja_bin"
if [ "$cmake_num" -lt 325 ]; then
  echo "[mla_ext cmake] SKIP: cmake $cmake_ver ($cmake_bin) is older than 3.25 (CMakeLists.txt minimum)"
  exit 77
fi
args=(-S "$here" -B "$build" -G Ninja -DPython3_EXECUTABLE="$py"
      -DCMAKE_MAKE_PROGRAM="$ninja_bin")
# Toolkit root: CUDA_HOME, else through the nvcc wrapper, else /usr/local/cuda.
if [ -z "${CUDA_HOME:-}" ]; then
  nv="$(command -v nvcc || true)"
  if [ -n "$nv" ] && head -c2 "$nv" | grep -q '#!'; then
    real="$(grep -o 'exec [^ ]*/bin/nvcc' "$nv" | awk '{print $2}' | head -1)"
    [ -n "$real" ] && CUDA_HOME="$(dirname "$(dirname "$real")")"
  elif [ -n "$nv" ]; then
    CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$nv")")")"
  fi
  [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ] && CUDA_HOME=/usr/local/cuda
fi
torch_cuda="$("$py" -c 'import torch; print(torch.version.cuda or "")')"
if [ -n "${CUDA_HOME:-}" ] && [ -n "$torch_cuda" ] && [ "${MLA_EXT_CUDA:-auto}" != 0 ]; then
  site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  nvrtc="$(ls "$site"/nvidia/cu13/lib/libnvrtc.so* 2>/dev/null | head -1 || true)"
  args+=(-DMLA_EXT_WITH_CUDA=ON -DCUDA_TOOLKIT_ROOT_DIR="$CUDA_HOME"
         -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc")
  [ -n "$nvrtc" ] && args+=(-DCUDA_nvrtc_LIBRARY="$nvrtc")
  # CMake < 3.26 does not know nvcc's C++20 flag ("CMake does not know the
  # flags to enable it"): tell it, as later releases do themselves.
  if [ "$cmake_num" -lt 326 ]; then
    args+=(-DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20
           -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20)
  fi
  archs="${TORCH_CUDA_ARCH_LIST:-8.0;8.6;8.9;9.0a}"
  ptx="${MLA_EXT_CUDA_PTX-9.0}"   # unset: 9.0; set but empty: no PTX
  args+=("-DMLA_EXT_CUDA_ARCH_LIST=$archs" "-DMLA_EXT_CUDA_PTX=$ptx")
  echo "[mla_ext cmake] cuda=ON archs=$archs ptx=$ptx toolkit=$CUDA_HOME"
else
  args+=(-DMLA_EXT_WITH_CUDA=OFF)
  echo "[mla_ext cmake] cuda=OFF"
fi
"$cmake_bin" "${args[@]}" "$@"
"$cmake_bin" --build "$build" -j "${MAX_JOBS:-2}"
