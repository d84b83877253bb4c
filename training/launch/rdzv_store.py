"""The job's rendezvous store: ``python -m training.launch.rdzv_store --port P``.

A plain multi-tenant c10d ``TCPStore`` in its own process (on EKS: a one-replica Deployment on
the system nodes behind the rendezvous Service). Every node's ``ft_launcher`` joins it as a
client (``--rdzv-conf=is_host=0``), so no training pod hosts the rendezvous and losing any one
of them, pod 0 included, costs an in-job restart instead of the Job. Each Job uses its own
rendezvous id (the Job's uid). Losing the store itself fails the running launchers: the Job's
backoff then replaces the pods and they resume from the last checkpoint.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
import threading


def serve(*, port: int) -> int:
    import torch.distributed as dist

    store = dist.TCPStore(
        host_name="0.0.0.0",
        port=port,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        use_libuv=True,
        timeout=datetime.timedelta(seconds=60),
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"rendezvous store listening on port {store.port}", flush=True)
    stop.wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.launch.rdzv_store")
    parser.add_argument("--port", type=int, required=True)
    return serve(port=parser.parse_args(argv).port)


if __name__ == "__main__":
    sys.exit(main())
