"""A run's record (`run.json`, trial markers), status classes, and export for trainers."""
