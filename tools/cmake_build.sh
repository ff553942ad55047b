#!/usr/bin/env bash
# Configure and build mla_ext._C with CMake + find_package(Torch).
#   tools/cmake_build.sh BUILD_DIR [extra cmake args...]
# Uses the venv's python (PYTHON env var overrides) and, when a CUDA toolkit is
# found, passes the paths torch's CMake config needs on these machines.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:?usage: cmake_build.sh BUILD_DIR}"; shift || true
py="${PYTHON:-$here/.venv/bin/python}"
cmake_bin="$(dirname "$py")/cmake"; [ -x "$cmake_bin" ] || cmake_bin=cmake
args=(-S "$here" -B "$build" -G Ninja -DPython3_EXECUTABLE="$py"
      -DCMAKE_MAKE_PROGRAM="$(dirname "$py")/ninja")
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
  archs="${TORCH_CUDA_ARCH_LIST:-8.6;9.0a}"
  args+=("-DMLA_EXT_CUDA_ARCH_LIST=$archs")
  echo "[mla_ext cmake] cuda=ON archs=$archs toolkit=$CUDA_HOME"
else
  args+=(-DMLA_EXT_WITH_CUDA=OFF)
  echo "[mla_ext cmake] cuda=OFF"
fi
"$cmake_bin" "${args[@]}" "$@"
"$cmake_bin" --build "$build" -j "${MAX_JOBS:-2}"
