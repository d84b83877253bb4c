"""The pod emulation: a rendered EKS Job's exact trainer command in emulated pods on this machine.

- ``cluster``: pods as network, mount and UTS namespaces on one bridge; the Job controller's
  rules (``run_job``).
- ``control_plane``: the node lifecycle, taint eviction, EKS node repair, PodGC and the
  scheduler's rules for nodes and hot spares, at scaled durations.
- ``kube_api``: the one piece of the Kubernetes API a trainer pod calls (cordon, spare list).
- ``ec2``: the EC2 API stand-in for the node fencer (moto in server mode, its own venv) and the
  hypervisor's side of a terminated instance (the node's processes killed).
- ``jobs``: whole scenarios (one Job on a fresh cluster; a node lost at a step) and what to
  read back from them: the tests (tests/pods) and ``bench.node_loss`` run the same ones.
- ``state``, ``slow_node``, ``machine``, ``model``: a run's final state, a slow node's duty
  cycle, what the emulation needs from the machine, the tiny model every emulated run trains.

Emulated, because they cannot exist here: the API server, the scheduler, EC2, the GPU and EFA.
Needs root (``ip netns``, ``unshare``).
"""
