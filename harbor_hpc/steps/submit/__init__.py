"""`submit` and `resubmit`: `checks` refuse what cannot run, `plan` groups, chunks and sizes the
attempts, `launch` records the run and queues its first wave, `waves` the rest as room frees;
`options` is what was asked. (Nothing is imported here: a Slurm element imports `waves` alone.)"""
