#!/usr/bin/env bash
# Written by `harbor-hpc setup-sh`. Prepares this task's container before the agent starts:
# Harbor's and NeMo Gym's Singularity flows run (or source) it with HARBOR_STAGING pointing at the
# staged environment/files folder. Running it again changes nothing.
#
# 1. The exec server those flows start inside the container needs uvicorn and fastapi in its own
#    Python (/opt/harbor-server, or $HARBOR_PYTHON). Nothing is installed when they import
#    already; otherwise they come from $HARBOR_STAGING/wheels when that folder holds wheels
#    (compute nodes are often offline), else from the package index.
# 2. Files the task's Dockerfile copies in (COPY/ADD), when the task runs on a shared base image
#    instead of its own build, are copied again from $HARBOR_STAGING/_replay.
#
# The body runs in a subshell so that, when sourced, it leaves the caller's shell options and
# variables alone; its exit status says whether the container is ready.

harbor_hpc_setup() (
  set -u
  staging="${HARBOR_STAGING:-/staging/env_files}"
  server_venv=/opt/harbor-server
  py="${HARBOR_PYTHON:-$server_venv/bin/python3}"

  say() { echo "[harbor-hpc setup.sh] $*" >&2; }

  has_wheels() { compgen -G "$staging/wheels/*.whl" >/dev/null; }

  server_deps_present() { [ -x "$py" ] && "$py" -c 'import uvicorn, fastapi' 2>/dev/null; }

  make_server_venv() {
    local system_python
    system_python="$(command -v python3 || true)"
    if [ -z "$system_python" ]; then
      say "no python3 in this image: the exec server cannot start; use an image with python3"
      return 1
    fi
    "$system_python" -m venv "$server_venv" 2>/dev/null \
      || "$system_python" -m venv --without-pip "$server_venv" \
      || { say "cannot create $server_venv"; return 1; }
    py="$server_venv/bin/python3"
  }

  # A Python without pip (Debian images lacking ensurepip) still takes wheels: a wheel is a zip of
  # what goes into site-packages.
  unpack_wheels() {
    "$py" - "$staging/wheels" <<'PYTHON'
import pathlib, sys, sysconfig, zipfile
site_packages = sysconfig.get_paths()["purelib"]
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    zipfile.ZipFile(wheel).extractall(site_packages)
PYTHON
  }

  install_server_deps() {
    server_deps_present && return 0
    [ -x "$py" ] || make_server_venv || return 1
    if "$py" -m pip --version >/dev/null 2>&1; then
      if has_wheels; then
        "$py" -m pip install --quiet --no-index --find-links "$staging/wheels" uvicorn fastapi
      else
        "$py" -m pip install --quiet uvicorn fastapi
      fi
    elif has_wheels; then
      unpack_wheels
    else
      say "$py has no pip and $staging/wheels holds no wheels"
      false
    fi || { say "installing uvicorn and fastapi failed"; return 1; }
    server_deps_present || { say "uvicorn and fastapi still do not import in $py"; return 1; }
    say "installed uvicorn and fastapi for $py"
  }

  # replay_file SRC DEST INTO_DIR CHOWN CHMOD: SRC (under the staging folder) becomes DEST, or
  # DEST/<name> when INTO_DIR is "dir" or DEST is already a folder, as Docker's COPY does.
  replay_file() {
    local src="$staging/_replay/$1" dest="$2"
    if [ "$3" = dir ] || [ -d "$dest" ]; then
      mkdir -p "$dest" && dest="$dest/${1##*/}"
    else
      mkdir -p "$(dirname "$dest")"
    fi && cp -a "$src" "$dest" && replay_owner "$dest" "$4" "$5"
  }

  # replay_dir SRC DEST CHOWN CHMOD: the contents of folder SRC go into folder DEST.
  replay_dir() {
    mkdir -p "$2" && cp -a "$staging/_replay/$1/." "$2/" && replay_owner "$2" "$3" "$4"
  }

  # replay_extract SRC DEST CHOWN CHMOD: ADD unpacks a local tar archive into DEST.
  replay_extract() {
    mkdir -p "$2" && tar -xf "$staging/_replay/$1" -C "$2" && replay_owner "$2" "$3" "$4"
  }

  replay_owner() {
    if [ -n "$2" ]; then chown -R "$2" "$1" || return 1; fi
    if [ -n "$3" ]; then chmod -R "$3" "$1" || return 1; fi
  }

  replay_copies() {
    @@REPLAY_COPIES@@
  }

  install_server_deps || return 1
  replay_copies || { say "replaying the Dockerfile's COPY/ADD failed"; return 1; }
)

harbor_hpc_setup
