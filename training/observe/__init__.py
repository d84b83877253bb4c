"""Prometheus metrics of a run: one exporter process per pod (or per local run) that reads the
run directory's logs and serves them, plus the launch helper the pod and local launchers use."""
