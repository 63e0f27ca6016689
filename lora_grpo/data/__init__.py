"""Prompts for a run: datasets and templates, local data files with file/line errors, and prompt batches."""
