#!/usr/bin/env bash
# Here (no GPU needed): put DeepGEMM's public source, with the CUTLASS and fmt headers its build and JIT include, into
# .deepgemm/src (ignored by git, carried to the GPU machine: about 30 MB). Never committed.
#   bash benchmarks/prepare_deepgemm.sh DEEPGEMM_GIT CUTLASS_GIT FMT_GIT
# (the git directories of fetched mirrors, e.g. /work/.mirror/deepseek-ai+DeepGEMM/repo). The CUTLASS and fmt
# commits are the ones DeepGEMM pins as submodules.
set -euo pipefail
DG=${1:?DeepGEMM git dir}; CUTLASS=${2:?CUTLASS git dir}; FMT=${3:?fmt git dir}
grep -qx '/.deepgemm/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.deepgemm/ >> .git/info/exclude; }
rm -rf .deepgemm && mkdir -p .deepgemm/src
git -C "$DG" archive HEAD | tar -x -C .deepgemm/src
pin() { git -C "$DG" ls-tree HEAD "third-party/$1" | awk '{print $3}'; }
mkdir -p .deepgemm/src/third-party/cutlass .deepgemm/src/third-party/fmt
git -C "$CUTLASS" archive "$(pin cutlass)" include/cute include/cutlass | tar -x -C .deepgemm/src/third-party/cutlass
git -C "$FMT" archive "$(pin fmt)" include | tar -x -C .deepgemm/src/third-party/fmt
echo "DeepGEMM $(git -C "$DG" rev-parse --short HEAD), CUTLASS $(pin cutlass | cut -c1-8), fmt $(pin fmt | cut -c1-8):" \
  "$(du -sh .deepgemm | cut -f1)"
