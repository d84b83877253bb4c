"""Launchers: ``local`` (CPU ranks on this machine) and ``eks`` (the Indexed Job on EKS)."""
