# The first lines of every element of harbor-hpc's Slurm array jobs: submit's (and resubmit's)
# trials, build --slurm and convert --slurm. submitit writes the rest of each element's batch
# script (its #SBATCH lines, then `exec python -m submitit.core._submit`: no srun step);
# harbor-hpc renders this file with Python's string.Template and gives it to submitit, which
# puts it under "# setup", before that line. Sites may change it (slurm/ in a checkout, harbor_hpc/_slurm where the
# wheel is installed), say to load a module every job needs; write a dollar sign the shell
# should see twice.
# Placeholder, a dollar sign and its name in braces:
#   setup  the site's lines (harbor-hpc.toml's setup, then --setup), as written
${setup}
