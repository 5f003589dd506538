#!/bin/bash
# The job that asks one node whether its Apptainer reads a zstd image (`harbor-hpc doctor
# --nodes`): one such job per node of the partition, each held to its node. harbor-hpc renders
# this file with Python's string.Template and queues it with sbatch; it reads the job's output.
# Sites may change it (slurm/ in a checkout, harbor_hpc/_slurm where the wheel is installed):
# keep the #SBATCH lines before the first command, and write a dollar sign the shell should see
# twice.
# Placeholders, each a dollar sign and its name in braces:
#   node       the node asked (--nodelist)
#   log        the job's output, which harbor-hpc reads
#   sbatch     further #SBATCH lines, one a line, maybe none: --partition, --account, --qos
#              and --sbatch-arg
#   setup      the site's lines (harbor-hpc.toml's setup), as written
#   image      a tiny zstd .sif in the store, shell-quoted
#   offset     where in it its root file system begins (for a node without Apptainer)
#   mark       the line printed once the image ran, shell-quoted
#SBATCH --job-name=harbor-hpc-ask-node
#SBATCH --nodelist=${node}
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH --mem=512M
#SBATCH --time=5
#SBATCH --output=${log}
#SBATCH --no-requeue
${sbatch}
# The site's lines first, as they are written (a module function may trip set -u).
${setup}
# The Apptainer our jobs would run there: HARBOR_HPC_APPTAINER, else the one on PATH. A node
# without one (enroot's) answers by what reads our containers' roots there: its unsquashfs,
# which unpacks them (the image's root listed: its superblock names its compression), and its
# squashfuse_ll, which mounts an image's root on its first use (mounted in a user namespace of
# the job's own, as our containers' are).
apptainer=$${HARBOR_HPC_APPTAINER:-apptainer}
if found=$$(command -v "$$apptainer") && [ -f "$$found" ] && [ -x "$$found" ]; then
  "$$apptainer" --version 2>&1
  "$$apptainer" exec ${image} /bin/sh -c true 2>&1 && echo ${mark}
else
  echo "no Apptainer: $$(unsquashfs -version 2>&1 | head -n 1)"
  mounted='d=$$(mktemp -d) && "$$1" -o offset="$$2" "$$3" "$$d" && ls -A "$$d" | grep -q .
    ok=$$?; umount "$$d" 2>/dev/null; rmdir "$$d"; exit $$ok'
  if ! said=$$(unsquashfs -o ${offset} -l ${image} 2>&1 >/dev/null); then
    printf '%s\n' "$${said:-unsquashfs failed}" | tail -n 1
  elif ! squashfuse=$$(command -v squashfuse_ll); then
    echo "no squashfuse_ll (squashfuse) on PATH: an image's first use mounts its .sif with it"
  elif said=$$(unshare --user --map-root-user --mount \
      sh -c "$$mounted" sh "$$squashfuse" ${offset} ${image} 2>&1); then
    echo ${mark}
  else
    printf 'squashfuse_ll: %s\n' "$${said:-cannot mount it}" | tail -n 1
  fi
fi
