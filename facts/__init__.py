"""Facts about the outside world (AWS services) that more than one part of the repository needs.

Standard library only: the CDK stack (`infra/`), the manifests and the planner all import it,
and it imports none of them.
"""
