"""Benchmarks of checkpointing, restart latency, goodput and overhead (``make bench``)."""
