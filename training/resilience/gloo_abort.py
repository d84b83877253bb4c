"""Release a rank blocked in a gloo collective, at once.

NVRx's abort only aborts NCCL. On gloo, none of torch 2.13's abort/shutdown calls releases a rank
blocked in a collective: it waits for the process-group timeout. Shutting down this process's
*established* TCP connections, other than those to the rendezvous/restart stores, makes gloo's
blocked send/recv fail immediately, so restart time is detection + re-initialisation + reload.

Linux-specific (reads /proc); listening sockets and store connections are never touched. On
other systems, or if /proc is unavailable, it does nothing and the process-group timeout
(``parallel.pg_timeout_s``) bounds the wait instead.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

ESTABLISHED = "01"


def _established_connections() -> dict[int, tuple[int, int]]:
    """inode -> (local port, remote port) for this network namespace's established TCP."""
    connections: dict[int, tuple[int, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) < 10 or fields[3] != ESTABLISHED:
                    continue
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                connections[int(fields[9])] = (local_port, remote_port)
    return connections


def shutdown_peer_sockets(*, keep_ports: set[int]) -> int:
    """Shut down this process's established TCP sockets except those whose local or remote
    port is in ``keep_ports`` (the stores). Returns how many were shut down."""
    connections = _established_connections()
    count = 0
    fd_dir = Path("/proc/self/fd")
    if not fd_dir.is_dir():
        return 0
    for entry in fd_dir.iterdir():
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if not target.startswith("socket:["):
            continue
        inode = int(target[len("socket:[") : -1])
        ports = connections.get(inode)
        if ports is None or ports[0] in keep_ports or ports[1] in keep_ports:
            continue
        try:
            duplicate = os.dup(int(entry.name))
        except OSError:
            continue
        # A duplicate shares the socket: shutdown() on it reaches gloo's own descriptor, and
        # closing the duplicate leaves gloo's descriptor for gloo to close.
        with contextlib.suppress(OSError), socket.socket(fileno=duplicate) as sock:
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
    return count
