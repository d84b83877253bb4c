"""Actions on a running Kubernetes cluster, through the kubernetes Python client.

`ops.cluster`: the client the launchers use from a workstation (apply, watch, stop a Job);
`ops.cordon`: what a trainer pod does on its own node (cordon it, count the hot spares). Below
every launcher and the preflight, above nothing first-party: the names of the project's
objects (job, claim, container, field manager) are passed in by the callers that render them.
"""
