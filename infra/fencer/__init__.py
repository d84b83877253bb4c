"""The node fencer: a GPU node that stops answering is fenced (its EC2 instance terminated) and
only then marked out of service, so Kubernetes fails its pods and the Job replaces them on a
spare (docs/node-loss.md, "The fencer").

Runs in the cluster as its own Deployment on the system nodes (infra/node_fencer.py), with the
project's own pinned ``kubernetes`` client and ``awscrt`` SigV4 signing (infra/aws_call.py):
boto3 cannot be installed beside that client (botocore pins python-dateutil<3, kubernetes 37
needs >=3). Modules: ``decide`` (what to fence now, pure), ``ec2`` (the two EC2 calls),
``controller`` (one pass over the Nodes), ``__main__`` (the loop).
"""
