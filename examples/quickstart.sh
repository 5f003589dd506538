#!/usr/bin/env bash
# The whole flow on the bundled example tasks, with the defaults:
#   build (Docker) -> convert (.sif store) -> rewrite --sif -> submit (Slurm, oracle) -> status -> export
# It works on a copy of examples/tasks in WORK (first argument, default ./quickstart), so the
# bundled tasks stay as they are. Run it again: every step does only what is left.
set -euo pipefail

WORK=${1:-quickstart}
REGISTRY=${HARBOR_HPC_REGISTRY:-localhost:5000/harbor-hpc-examples}
EXAMPLES=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/tasks

# A registry on this machine speaks plain HTTP; Apptainer has to be told so.
nohttps=()
case $REGISTRY in localhost:* | 127.0.0.1:*) nohttps=(--nohttps) ;; esac

mkdir -p "$WORK"
rm -rf "$WORK/tasks"
cp -r "$EXAMPLES" "$WORK/tasks"

harbor-hpc build "$WORK/tasks" --registry "$REGISTRY" --manifest "$WORK/manifest.json"
harbor-hpc convert --manifest "$WORK/manifest.json" --cache-dir "$WORK/sif" "${nohttps[@]}"
harbor-hpc rewrite "$WORK/tasks" --manifest "$WORK/manifest.json" --sif
harbor-hpc submit "$WORK/tasks" --agent oracle --run-dir "$WORK/run" --cache-dir "$WORK/sif" --wait
harbor-hpc status "$WORK/run"
harbor-hpc export "$WORK/run" --out "$WORK/rollouts.jsonl"
