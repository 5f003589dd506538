"""The steps, one module per subcommand over the backends (`slurm`, `ray`, `apptainer`,
`images`): each takes a request (harbor-hpc.toml filling in through `core.config.configured`,
for the CLI and the Python API alike) and returns a typed result the CLI renders."""
