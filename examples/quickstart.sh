#!/usr/bin/env bash
# The whole flow on the bundled example tasks, with the defaults:
#   build (Docker, else Apptainer) -> convert (.sif store) -> rewrite --sif -> submit (Slurm,
#   oracle) -> status -> export
# It works on a copy of examples/tasks in WORK (first argument, default ./quickstart), so the
# bundled tasks stay as they are. Run it again: every step does only what is left.
#
# The examples build FROM a public Debian image with python3 (their Dockerfiles' ARG BASE_IMAGE).
# A machine that cannot pull it (offline, like CI) names one it has in HARBOR_HPC_BASE_IMAGE;
# the value is part of the images' content hash, so each base makes images of its own.
set -euo pipefail

WORK=${1:-quickstart}
REGISTRY=${HARBOR_HPC_REGISTRY:-localhost:5000/harbor-hpc-examples}
EXAMPLES=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/tasks

base=()
if [ -n "${HARBOR_HPC_BASE_IMAGE:-}" ]; then base=(--build-arg "BASE_IMAGE=$HARBOR_HPC_BASE_IMAGE"); fi

mkdir -p "$WORK"
rm -rf "$WORK/tasks"
cp -r "$EXAMPLES" "$WORK/tasks"

# Without Docker, build makes each .sif itself, in the same store convert and submit use.
if ! harbor-hpc build "$WORK/tasks" --registry "$REGISTRY" --manifest "$WORK/manifest.json" \
  --cache-dir "$WORK/sif" "${base[@]}"; then
  if [ ${#base[@]} -eq 0 ]; then
    echo "quickstart: if the public base image could not be pulled here, set" \
      "HARBOR_HPC_BASE_IMAGE to a Debian image with python3 that this machine has" \
      "(in a registry where Apptainer builds, without Docker)" >&2
  fi
  exit 1
fi
harbor-hpc convert --manifest "$WORK/manifest.json" --cache-dir "$WORK/sif"
harbor-hpc rewrite "$WORK/tasks" --manifest "$WORK/manifest.json" --sif
harbor-hpc submit "$WORK/tasks" --agent oracle --run-dir "$WORK/run" --cache-dir "$WORK/sif" --wait
harbor-hpc status "$WORK/run"
harbor-hpc export "$WORK/run" --out "$WORK/rollouts.jsonl"
