#!/usr/bin/env bash
# Build a DeepEP wheel from a DeepEP source directory (its public source, never committed here), or reuse one.
#   bash benchmarks/build_deepep.sh SRC_DIR WHEEL_DIR      -> WHEEL_DIR/deep_ep-*.whl
# Intranode kernels only by default (DEEPEP_NVSHMEM=0): they need no NVSHMEM and build in minutes. With
# DEEPEP_NVSHMEM=1 the build also compiles the internode and low-latency kernels against the nvidia-nvshmem wheel.
# Install the result with: pip install --no-deps --target /tmp/site WHEEL_DIR/deep_ep-*.whl
set -euo pipefail
SRC=${1:?DeepEP source directory}; WHEELS=${2:?wheel output directory}
mkdir -p "$WHEELS"; WHEELS=$(cd "$WHEELS" && pwd)
if ls "$WHEELS"/deep_ep-*.whl >/dev/null 2>&1; then echo "reusing $(ls "$WHEELS"/deep_ep-*.whl)"; exit 0; fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
BUILD=$(mktemp -d); cp -r "$SRC"/. "$BUILD"; cd "$BUILD"
python3 - "$WHEELS" "${DEEPEP_NVSHMEM:-0}" <<'PY'
import runpy, sys
wheels, nvshmem = sys.argv[1], sys.argv[2] == "1"
if not nvshmem:
    sys.modules["nvidia.nvshmem"] = None  # DeepEP's setup.py then builds without NVSHMEM (intranode only)
import torch.utils.cpp_extension as ce
_extension = ce.CUDAExtension
def extension(*args, **kw):
    # relocatable device code (-rdc=true) needs a device-link step; DeepEP adds one only with NVSHMEM
    flags = kw.get("extra_compile_args", {})
    if "-rdc=true" in flags.get("nvcc", []) and not flags.get("nvcc_dlink"):
        flags["nvcc_dlink"] = ["-dlink"]
    return _extension(*args, **kw)
ce.CUDAExtension = extension
sys.argv = ["setup.py", "bdist_wheel", "-d", wheels]
runpy.run_path("setup.py", run_name="__main__")
PY
ls -la "$WHEELS"
