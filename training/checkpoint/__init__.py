"""Checkpoints: the on-disk layout and commit protocol (``layout``), the manager the run uses
(``manager``), NVRx's asynchronous writer and its helper processes (``nvrx_async``,
``lifetime``), and the node-local NVMe tier (``local``)."""
