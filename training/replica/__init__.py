"""Replica groups (``resilience.restart=replica``): HSDP with FSDP2 inside a group and torchft
across groups, so a fault stops only its own group (docs/replica-groups.md)."""
