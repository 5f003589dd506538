"""harbor-hpc: Harbor agent tasks on Slurm clusters with Apptainer.

The Python API is `harbor_hpc.api`; the environments Harbor loads by import path are in
`harbor_hpc.environment`; the command line is `harbor-hpc` (`harbor_hpc.cli`).
"""
