#!/usr/bin/env bash
# Stash and install the vLLM wheelhouse on a lent H200 machine (built here by tests/gpu/wheelhouse.py).
#
#   bash tests/gpu/install_wheelhouse.sh stash N   # copy .gpuwh/partN/* (carried in this call) to /tmp/gpuwh/
#   bash tests/gpu/install_wheelhouse.sh install   # check every part against MANIFEST.json, join, untar,
#                                                  # pip install into /tmp/site, check, print the exports
#
# One call per part, back to back (a call's carry replaces the last call's; /tmp stays while the machine is
# warm): carry=['.gpuwh/part1'] -> `stash 1`, carry=['.gpuwh/part2'] -> `stash 2`, ..., and in the last call
# `stash N && install`. `install` is idempotent: with /tmp/site/vllm there it does nothing (rm -rf /tmp/site to
# redo it). MANIFEST.json travels with part 1, so `stash N` checks part N at once when part 1 came first.
#
# Environment: GPUWH_SRC (.gpuwh), GPUWH_DIR (/tmp/gpuwh), GPUWH_SITE (/tmp/site), PYTHON (python3);
# GPUWH_CHECK=0 skips the requirement check and the `from vllm import LLM` smoke test after installing.
set -euo pipefail

# A rule of those machines: NVLink multicast stays off, in this process and every one started from it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SRC=${GPUWH_SRC:-.gpuwh}
DIR=${GPUWH_DIR:-/tmp/gpuwh}
SITE=${GPUWH_SITE:-/tmp/site}
PY=${PYTHON:-python3}
WH=("$PY" "$HERE/wheelhouse.py")

die() {
  echo "install_wheelhouse: $*" >&2
  exit 1
}

guidance() {
  cat <<EOF
install_wheelhouse: vLLM is in $SITE. In each later call (same warm machine):
  export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn  # flashinfer is not carried; fork hung
EOF
}

stash() {
  local n=${1:-}
  [[ $n =~ ^[1-9][0-9]*$ ]] || die "usage: stash N (a part number, 1 or more), got '${n}'"
  local from="$SRC/part$n"
  [[ -d $from ]] || die "$from is not in this call's tree: carry it (carry=['$from']) in the call that stashes it"
  compgen -G "$from/*" >/dev/null || die "$from is empty: carry=['$from'] must name it in this call"
  mkdir -p "$DIR"
  cp -f "$from"/* "$DIR"/
  if [[ -f $DIR/MANIFEST.json ]]; then
    "${WH[@]}" unpack "$DIR" --part "$n"
  else
    echo "install_wheelhouse: stashed $from in $DIR (not checked yet: MANIFEST.json comes with part 1)"
  fi
}

install() {
  if [[ -d $SITE/vllm ]]; then
    echo "install_wheelhouse: $SITE/vllm is there already: nothing to do"
    guidance
    return 0
  fi
  [[ -d $DIR ]] || die "$DIR is missing: stash the parts first (bash $0 stash N, one call per part)"
  "${WH[@]}" unpack "$DIR" || die "the parts in $DIR do not make the wheelhouse (above); stash the named part again"
  mkdir -p "$SITE"
  # --upgrade: pip --target skips (with a warning) whatever an earlier, broken attempt left in $SITE.
  PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" "$DIR"/wheels/*.whl
  rm -rf "$DIR/wheels"
  if [[ ${GPUWH_CHECK:-1} != 0 ]]; then
    PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "${WH[@]}" check "$DIR" "$SITE"
    PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" VLLM_USE_FLASHINFER_SAMPLER=0 "$PY" -c \
      'import vllm; from vllm import LLM; print("install_wheelhouse: import vllm", vllm.__version__, "ok")' ||
      die "vLLM is installed in $SITE but 'from vllm import LLM' fails (above)"
  fi
  guidance
}

case ${1:-} in
  stash) stash "${2:-}" ;;
  install) install ;;
  *) die "usage: bash $0 stash N | install" ;;
esac
