"""The Slurm backend: every Slurm command (`cluster`, submitit included) and where jobs go
(`SlurmPlacement`), the worker that runs trials in array elements, the sizing of elements,
the Slurm builder, and which of a run's jobs still live."""
