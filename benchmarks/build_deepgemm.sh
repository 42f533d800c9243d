#!/usr/bin/env bash
# On the GPU machine: build DeepGEMM's C++ module in place from .deepgemm/src (benchmarks/prepare_deepgemm.sh), as
# its develop.sh does, so that `import deep_gemm` works with PYTHONPATH=.deepgemm/src. Its kernels compile at run time
# with nvcc (JIT), into $DG_JIT_CACHE_DIR.
# On the GPU image, setuptools links with /opt/gcc/bin/g++, which puts a static libstdc++ into the module; beside
# torch's shared one it segfaults at its first locale use (std::regex, ostream <<). So the module is relinked with
# the plain Ubuntu g++ against the shared libstdc++.
set -euo pipefail
SRC=$(cd "${1:-.deepgemm/src}" && pwd)
cd "$SRC"
ln -sfn "$SRC/third-party/cutlass/include/cutlass" deep_gemm/include/cutlass
ln -sfn "$SRC/third-party/cutlass/include/cute" deep_gemm/include/cute
if ! ls deep_gemm/_C*.so >/dev/null 2>&1; then
  DG_USE_LOCAL_VERSION=0 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} python3 setup.py build > build.log 2>&1 \
    || { tail -30 build.log; exit 1; }
  ln -sf "$(find "$SRC/build" -name '_C*.so' | head -1)" deep_gemm/
fi
if ! ldd deep_gemm/_C*.so | grep -q 'libstdc++'; then
  cxx=$(ls /usr/bin/x86_64-linux-gnu-g++-* 2>/dev/null | sort -V | tail -1)
  link=$(grep -E '^[^ ]*g\+\+ .* -shared ' build.log | tail -1)
  [ -n "$cxx" ] && [ -n "$link" ] || { echo "cannot relink deep_gemm/_C (compiler '$cxx')" >&2; exit 1; }
  echo "relinking deep_gemm/_C with $cxx" >&2
  $cxx ${link#* } >> build.log 2>&1
  ldd deep_gemm/_C*.so | grep -q 'libstdc++' || { echo "deep_gemm/_C still links libstdc++ statically" >&2; exit 1; }
fi
ls deep_gemm/_C*.so
