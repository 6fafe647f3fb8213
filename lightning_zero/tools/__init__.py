"""Experiment tooling on top of the strategies: Hydra config schemas, the CLI, multirun, run statistics, sweep
results and reports. Nothing below imports from here."""
