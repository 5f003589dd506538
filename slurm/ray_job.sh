#!/bin/bash
# The Slurm job of a Ray cluster (`harbor-hpc ray up`): one task per Ray node, each running
# harbor_hpc.ray.node. harbor-hpc renders this file with Python's string.Template into the
# cluster's folder (job.sh) and queues it with sbatch. Sites may change it (slurm/ in a checkout,
# harbor_hpc/_slurm where the wheel is installed): keep the #SBATCH lines before the first
# command, and write a dollar sign the shell should see twice.
# Placeholders, each a dollar sign and its name in braces:
#   nodes           Slurm nodes (--nodes)
#   tasks_per_node  Ray nodes on each of them (--ray-nodes-per-node)
#   time_min        the job's time limit in minutes (--time, else 60)
#   log             the job's log, job-%j.log in the cluster's folder
#   sbatch          further #SBATCH lines, one a line, maybe none: --cpus-per-task
#                   (--cpus-per-node), then --partition, --account, --qos and --sbatch-arg
#   setup           the site's lines (harbor-hpc.toml's setup, then --setup), as written
#   node            the command each task runs, shell-quoted: python -m harbor_hpc.ray.node
#                   CLUSTER_DIR [--join ADDRESS] [--labels LABELS]
#SBATCH --job-name=harbor-hpc-ray
#SBATCH --nodes=${nodes}
#SBATCH --ntasks-per-node=${tasks_per_node}
#SBATCH --time=${time_min}
#SBATCH --output=${log}
${sbatch}
# A node lost (crashed, cut off) takes only its own Ray node: the job keeps the others
# (--no-kill), and is never run again from the start (a new head, at a new address).
#SBATCH --no-kill
#SBATCH --no-requeue
# The site's lines first, as they are written (a module function may trip set -u).
${setup}
set -euo pipefail
umask 077
# A worker that ends (its Ray lost) leaves the others be; the head's end ends the job.
exec srun --no-kill --kill-on-bad-exit=0 ${node}
