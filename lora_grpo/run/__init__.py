"""A run on disk and what it reports: its directory, checkpoints (the best among them), failures, stopping,
health, metrics and plots."""
