"""The Byzantine ranks mode: membership and its counting, the signed wire format, and per-step agreement (PBFT)."""
