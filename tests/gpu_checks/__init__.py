"""The check functions of the device check (tests/gpu_check.py, whose ``CHECKS`` table names,
orders and documents them)."""
