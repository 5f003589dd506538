"""What every step shares: errors, atomic files and locks, configuration, step results."""
