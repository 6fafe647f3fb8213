"""Communication: the collectives shim every engine talks through (with its byte ledger) and bucketing math."""
