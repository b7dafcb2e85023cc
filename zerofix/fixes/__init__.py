"""One thin module per fix: its wrappers and its structural check, nothing else."""
