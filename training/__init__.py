"""Fault-tolerant FSDP2 trainer (PyTorch + NVIDIA Resiliency Extension)."""

import warnings

# torch imports the deprecated ``pynvml`` package that nvidia-resiliency-ext pulls in; the
# warning is noise on every rank and in every CLI error message.
warnings.filterwarnings(
    "ignore", message="The pynvml package is deprecated", category=FutureWarning
)
