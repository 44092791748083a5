#!/usr/bin/env bash
# Build (or re-check) a side venv in which the tests talk to a real vLLM, one per version.
#
#   bash tools/oracle/setup.sh [VERSION] [VENV]
#       VERSION  0.33.0 (default) or 0.34.0: the vLLMs the oracle tools are checked against
#       VENV     default: ~/.cache/mmreuse/venv-oracle-VERSION
#   (an older form, `setup.sh VENV`, still means VERSION 0.33.0)
#
# What goes in (CPU only, Python 3.11, about 2 GB each):
#   torch 2.13.0                 `pip install torch==2.13.0` (the machine's pip configuration
#                                serves the +cpu wheel where it has one). vLLM 0.34.0's wheel
#                                asks for torch 2.14.0, but everything the oracles import (its
#                                CPU-side Python: block hashing, Request, scheduler, block pool,
#                                encoder cache, EC connectors, KV events) runs on 2.13.0, which
#                                keeps one torch for the project and both oracles.
#   vllm VERSION                 the registry's wheel, fetched once with `pip download --no-deps
#                                --only-binary=:all:` into VENV/.cache, sha256 checked, installed
#                                with --no-deps
#   tools/oracle/requirements.lock   exact pins, --no-deps (tools/oracle/requirements-VERSION.lock
#                                instead, where a version needs other pins)
# then an import check and `hash_oracle.py --self-test`. A stamp in VENV records what was
# checked; when it matches, a re-run only runs the self-test. When it does not (a new lock, an
# existing venv built another way), installed versions are compared with the pins and only the
# differing packages are installed.
# Env: PYTHON (interpreter for a new venv), VLLM_WHEEL (a local copy of the wheel, still
#      sha256 checked), MMREUSE_ORACLE_FORCE=1 (re-check the pins even if the stamp matches).
# Adding a vLLM version: a line in the case below (wheel name and sha256 from PyPI), then
# docs/development.md "Adding a vLLM version".
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
case "${1:-}" in
  [0-9]*.[0-9]*.[0-9]*) VLLM_PIN="$1"; VENV="${2:-$HOME/.cache/mmreuse/venv-oracle-$1}" ;;
  "") VLLM_PIN="0.33.0"; VENV="$HOME/.cache/mmreuse/venv-oracle-0.33.0" ;;
  *) VLLM_PIN="0.33.0"; VENV="$1" ;;
esac
case "$VLLM_PIN" in
  0.33.0) VLLM_WHEEL_SHA256="4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa" ;;
  0.34.0) VLLM_WHEEL_SHA256="79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2" ;;
  *) echo "oracle setup: VERSION must be 0.33.0 or 0.34.0, got '$VLLM_PIN'" >&2; exit 2 ;;
esac
VLLM_WHEEL_NAME="vllm-$VLLM_PIN-cp38-abi3-manylinux_2_28_x86_64.whl"
LOCK="$HERE/requirements-$VLLM_PIN.lock"
[ -f "$LOCK" ] || LOCK="$HERE/requirements.lock"
ORACLE="$HERE/hash_oracle.py"
TORCH_PIN="2.13.0"
STAMP="$VENV/.mmreuse-oracle-stamp"

STEP="start"
say() { echo "oracle setup: $*"; }
fail() { echo "oracle setup: FAILED at step '$STEP': $*" >&2; exit 1; }
trap 'echo "oracle setup: FAILED at step '"'"'$STEP'"'"' (exit $?); see the output above" >&2' ERR
step() { STEP="$1"; }

step "find files next to setup.sh"
[ -f "$LOCK" ] || fail "missing $LOCK"
[ -f "$ORACLE" ] || fail "missing $ORACLE"

# ---- interpreter and venv ---------------------------------------------------------------
step "create venv $VENV"
if [ ! -x "$VENV/bin/python" ]; then
  PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3 || true)}"
  [ -n "$PYTHON" ] || fail "no python3.11 on PATH (set PYTHON=/path/to/python3.11)"
  say "creating $VENV with $PYTHON"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV" || fail "'$PYTHON -m venv $VENV' did not work"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check)

step "check the venv's python version"
PYVER="$("$VPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
case "$PYVER" in
  3.11) ;;
  3.12|3.13|3.14) say "warning: python $PYVER; the pins were made and tested on 3.11" ;;
  *) fail "python $PYVER in $VENV; vllm $VLLM_PIN needs 3.11 (>=3.11,<3.15)" ;;
esac

sha() { sha256sum "$1" | cut -d' ' -f1; }
WANT_STAMP="python=$PYVER torch=$TORCH_PIN vllm=$VLLM_PIN wheel=$VLLM_WHEEL_SHA256 lock=$(sha "$LOCK")"

if [ "${MMREUSE_ORACLE_FORCE:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT_STAMP" ]; then
  step "self-test (stamp matches)"
  if "$VPY" "$ORACLE" --self-test; then
    say "ready: $VENV"
    exit 0
  fi
  say "the stamp matches but the self-test failed; re-checking every pin"
fi
rm -f "$STAMP"

# installed_version DIST: the installed version of a distribution, or nothing.
installed_version() {
  "$VPY" -c 'import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass' "$1"
}

# ---- torch ------------------------------------------------------------------------------
step "install torch==$TORCH_PIN"
have="$(installed_version torch)"
if [ "${have%%+*}" = "$TORCH_PIN" ]; then
  say "torch $have already installed"
else
  say "installing torch==$TORCH_PIN (found: ${have:-none})"
  "${PIP[@]}" install --no-deps "torch==$TORCH_PIN"
  have="$(installed_version torch)"
  [ "${have%%+*}" = "$TORCH_PIN" ] || fail "torch is ${have:-missing} after installing $TORCH_PIN"
fi

# ---- vllm -------------------------------------------------------------------------------
step "install vllm==$VLLM_PIN"
have="$(installed_version vllm)"
if [ "$have" = "$VLLM_PIN" ]; then
  say "vllm $have already installed"
else
  WHEEL="${VLLM_WHEEL:-$VENV/.cache/$VLLM_WHEEL_NAME}"
  if [ ! -f "$WHEEL" ]; then
    step "download vllm==$VLLM_PIN (240-340 MB)"
    say "downloading vllm==$VLLM_PIN into $VENV/.cache"
    mkdir -p "$VENV/.cache"
    "${PIP[@]}" download --no-deps --only-binary=:all: "vllm==$VLLM_PIN" -d "$VENV/.cache"
    WHEEL="$VENV/.cache/$VLLM_WHEEL_NAME"
    [ -f "$WHEEL" ] || fail "pip download did not produce $VLLM_WHEEL_NAME (got: $(ls "$VENV/.cache"))"
  fi
  step "verify the vllm wheel's sha256"
  got="$(sha "$WHEEL")"
  [ "$got" = "$VLLM_WHEEL_SHA256" ] || fail "$WHEEL has sha256 $got, expected $VLLM_WHEEL_SHA256"
  step "install vllm==$VLLM_PIN"
  "${PIP[@]}" install --no-deps "$WHEEL"
fi

# ---- the lock ---------------------------------------------------------------------------
step "compare installed packages with requirements.lock"
MISSING="$("$VPY" - "$LOCK" <<'PY'
import importlib.metadata as m
import re
import sys

for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, _, version = line.partition("==")
    if not version:
        sys.exit(f"requirements.lock: not an exact pin: {line!r}")
    try:
        have = m.version(re.sub(r"[-_.]+", "-", name))
    except m.PackageNotFoundError:
        have = None
    if have != version:
        print(line)
PY
)"
if [ -z "$MISSING" ]; then
  say "all pins in requirements.lock already installed"
else
  step "install requirements.lock (--no-deps)"
  say "installing $(echo "$MISSING" | wc -l) pinned packages"
  # shellcheck disable=SC2086  # one requirement per word
  "${PIP[@]}" install --no-deps $MISSING
fi

# ---- checks -----------------------------------------------------------------------------
step "import the vLLM modules the oracles use"
"$VPY" - <<'PY'
import warnings

warnings.filterwarnings("ignore")
import cbor2, msgspec, xxhash  # noqa: F401,E401
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: F401
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: F401
from vllm.v1.core.block_pool import BlockPool  # noqa: F401
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager  # noqa: F401
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: F401
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
from vllm.v1.engine import EngineCoreRequest  # noqa: F401
from vllm.v1.request import Request  # noqa: F401
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: F401
PY

step "oracle self-test"
"$VPY" "$ORACLE" --self-test || fail "$ORACLE --self-test did not pass in $VENV"
echo "$WANT_STAMP" > "$STAMP"
trap - ERR
say "ready: $VENV   (oracle: $VPY $ORACLE --help)"
