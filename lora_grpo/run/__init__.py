"""A run on disk and what it reports: its directory, checkpoints, failures, stopping, health, metrics and
plots."""
