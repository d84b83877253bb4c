"""The trainer's container image: an ECR repository and a Docker image asset built from
training/Dockerfile at deploy time (synth only fingerprints the files; it needs no Docker)."""

from __future__ import annotations

from pathlib import Path

from aws_cdk import IgnoreMode, RemovalPolicy
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_ecr_assets as ecr_assets
from constructs import Construct

from infra.config import ImageConfig

# The build context is the repository root (the image runs `pip install .[train]`);
# .dockerignore keeps .venv, node_modules, cdk.out, runs, data and .git out of it.
REPO_ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = "training/Dockerfile"


class TrainerImage(Construct):
    """Attributes: `repository` (for images pushed outside CDK, e.g. by CI) and `image_uri` (what
    the pods run: the configured prebuilt image, or the asset CDK builds and publishes)."""

    def __init__(self, scope: Construct, construct_id: str, *, config: ImageConfig) -> None:
        super().__init__(scope, construct_id)
        self.repository = ecr.Repository(
            self,
            "Repository",
            repository_name=config.repository_name,
            image_scan_on_push=True,
            # A tag always names the same image: a restarted pod never runs different code.
            image_tag_mutability=ecr.TagMutability.IMMUTABLE,
            # KMS (the AWS-managed aws/ecr key) rather than AES256: the IaC scan's CKV_AWS_136.
            encryption=ecr.RepositoryEncryption.KMS,
            lifecycle_rules=[ecr.LifecycleRule(max_image_count=20, description="last 20 images")],
            removal_policy=RemovalPolicy.DESTROY,
            empty_on_delete=True,
        )
        if config.image_uri:
            self.asset: ecr_assets.DockerImageAsset | None = None
            self.image_uri = config.image_uri
        else:
            self.asset = ecr_assets.DockerImageAsset(
                self,
                "Asset",
                directory=str(REPO_ROOT),
                file=DOCKERFILE,
                # p5 nodes are x86_64; building on an arm64 laptop must still give amd64.
                platform=ecr_assets.Platform.LINUX_AMD64,
                # .dockerignore decides what the context holds and what the hash covers, with
                # Docker's own matching rules.
                ignore_mode=IgnoreMode.DOCKER,
            )
            self.image_uri = self.asset.image_uri
