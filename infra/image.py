"""The container images: the trainer's (training/Dockerfile), the rendezvous store's
(infra/rdzv-store.Dockerfile) and the node fencer's (infra/fencer.Dockerfile), each a Docker
image asset built at deploy time (synth only
fingerprints the files; it needs no Docker).

Each asset's hash covers its own build context only: the trainer's is the repository root
narrowed by .dockerignore (an allow-list of image inputs); the store's is the few files its
Dockerfile copies (STORE_CONTEXT). A new trainer image therefore never changes the store's pod
template, and deploy state or docs never change either image.
"""

from __future__ import annotations

from pathlib import Path

from aws_cdk import IgnoreMode
from aws_cdk import aws_ecr_assets as ecr_assets
from constructs import Construct

from infra.config import ImageConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = "training/Dockerfile"
STORE_DOCKERFILE = "infra/rdzv-store.Dockerfile"
# The store image's build context, after .dockerignore: everything out, then exactly what
# STORE_DOCKERFILE copies (Docker's matching rules: the last matching pattern wins).
STORE_CONTEXT = (
    STORE_DOCKERFILE,
    "training/__init__.py",
    "training/launch/__init__.py",
    "training/launch/rdzv_store.py",
)
FENCER_DOCKERFILE = "infra/fencer.Dockerfile"
# The node fencer's build context (infra/node_fencer.py deploys it): what its Dockerfile copies.
FENCER_CONTEXT = (
    FENCER_DOCKERFILE,
    "infra/__init__.py",
    "infra/aws_call.py",
    *(
        f"infra/fencer/{name}.py"
        for name in ("__init__", "__main__", "controller", "decide", "ec2", "metrics", "settings")
    ),
)


def _asset(
    scope: Construct,
    construct_id: str,
    *,
    directory: Path,
    file: str,
    only: tuple[str, ...] = (),
) -> ecr_assets.DockerImageAsset:
    return ecr_assets.DockerImageAsset(
        scope,
        construct_id,
        directory=str(directory),
        file=file,
        # p5 and the system nodes are x86_64; building on an arm64 laptop must still give amd64.
        platform=ecr_assets.Platform.LINUX_AMD64,
        # .dockerignore (then `only`, as an allow-list) decides what the context holds and what
        # the hash covers, with Docker's own matching rules.
        ignore_mode=IgnoreMode.DOCKER,
        exclude=["*", *(f"!{path}" for path in only)] if only else None,
    )


class TrainerImage(Construct):
    """Attributes: `image_uri` (what the training pods run: the configured prebuilt image, or
    the asset CDK builds and publishes), `store_image_uri` (the rendezvous store's own image),
    `fencer_image_uri` (the node fencer's)
    and `tags` (the image tags the stack runs, which the repository's lifecycle keeps)."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ImageConfig,
        directory: Path = REPO_ROOT,
    ) -> None:
        super().__init__(scope, construct_id)
        if config.image_uri:
            self.asset: ecr_assets.DockerImageAsset | None = None
            self.image_uri = config.image_uri
        else:
            self.asset = _asset(self, "Asset", directory=directory, file=DOCKERFILE)
            self.image_uri = self.asset.image_uri
        self.store_asset = _asset(
            self, "StoreAsset", directory=directory, file=STORE_DOCKERFILE, only=STORE_CONTEXT
        )
        self.store_image_uri = self.store_asset.image_uri
        self.fencer_asset = _asset(
            self, "FencerAsset", directory=directory, file=FENCER_DOCKERFILE, only=FENCER_CONTEXT
        )
        self.fencer_image_uri = self.fencer_asset.image_uri
        # The synthesizer tags each asset with its hash (no tag prefix is configured).
        self.tags = tuple(
            a.asset_hash for a in (self.asset, self.store_asset, self.fencer_asset) if a is not None
        )
