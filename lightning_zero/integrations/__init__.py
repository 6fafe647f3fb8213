"""Adapters for running lightning_zero's strategies under other frameworks' launchers; each needs its own extra."""
