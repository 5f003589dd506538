"""`python -m harbor_hpc` runs the same CLI as the `harbor-hpc` console script."""

from harbor_hpc.cli import main

main()
