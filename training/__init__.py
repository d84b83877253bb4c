"""Fault-tolerant FSDP2 trainer (PyTorch + NVIDIA Resiliency Extension)."""
