"""harbor-hpc: Harbor agent tasks on Slurm clusters with Apptainer."""
