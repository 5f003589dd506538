"""Submitting runs of Harbor trials as submitit array jobs (Slurm, or local processes)."""
