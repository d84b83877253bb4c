# The node fencer's own image (infra/fencer, deployed by infra/node_fencer.py): Python, the
# project's pinned Kubernetes client, awscrt (SigV4 for the two EC2 calls) and prometheus_client
# (its /metrics), and the fencer's modules only. Built from the repository root with infra/image.py's allow-list (FENCER_CONTEXT),
# so only a change to these files makes a new fencer image.
#   docker build --platform linux/amd64 -f infra/fencer.Dockerfile -t fsdp-node-fencer .
# The versions are requirements.lock's (tests/infra/test_node_fencer.py checks they agree).
ARG PYTHON_VERSION=3.12
FROM python:${PYTHON_VERSION}-slim
ARG KUBERNETES_VERSION=37.0.2
ARG AWSCRT_VERSION=0.38.0
ARG PROMETHEUS_CLIENT_VERSION=0.26.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN pip install "kubernetes==${KUBERNETES_VERSION}" "awscrt==${AWSCRT_VERSION}" \
      "prometheus-client==${PROMETHEUS_CLIENT_VERSION}" \
 && python -c "import kubernetes, awscrt.auth, prometheus_client"
WORKDIR /app
COPY infra/__init__.py infra/aws_call.py infra/
COPY infra/fencer/__init__.py infra/fencer/__main__.py infra/fencer/controller.py \
     infra/fencer/decide.py infra/fencer/ec2.py infra/fencer/metrics.py \
     infra/fencer/settings.py infra/fencer/
# No root needed: it only calls the Kubernetes API and EC2.
USER 65534:65534
ENTRYPOINT []
CMD ["python", "-m", "infra.fencer"]
