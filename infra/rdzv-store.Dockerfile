# The rendezvous store's own image: Python, the CPU build of torch (TCPStore) and the one module
# the store runs (training/launch/rdzv_store.py, which imports torch alone). Built from the
# repository root with infra/image.py's allow-list, so only a change to these files or to this
# Dockerfile makes a new store image: a trainer change, `make gpu-nodes` or a docs edit never
# restarts the store that running launchers depend on.
#   docker build --platform linux/amd64 -f infra/rdzv-store.Dockerfile -t fsdp-rdzv-store .
# torch: the trainer's version (training/Dockerfile's TORCH_VERSION; tests/infra checks they
# agree), so the store speaks the launchers' TCPStore protocol. The CPU wheel keeps the image
# small (no CUDA libraries: the store never touches a GPU).
ARG PYTHON_VERSION=3.12
ARG TORCH_VERSION=2.13.0
FROM python:${PYTHON_VERSION}-slim
ARG TORCH_VERSION
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
 && python -c "import torch.distributed as d; assert d.is_available()"
# /app: the store container's workingDir (manifests/render.py).
WORKDIR /app
COPY training/__init__.py training/
COPY training/launch/__init__.py training/launch/rdzv_store.py training/launch/
# No root needed: the store listens on an unprivileged port.
USER 65534:65534
ENTRYPOINT []
CMD ["python", "-m", "training.launch.rdzv_store", "--help"]
