"""ZeRO: the flat partition math, stages 1 and 2 (``stage12``), sharded checkpoint I/O; stage 3 in ``stage3``."""
