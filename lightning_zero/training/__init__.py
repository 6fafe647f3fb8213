"""What a strategy applies to a run: precision policy and loss scaler, activation checkpointing, sync
batch norm, model-state accounting, module-class settings."""
