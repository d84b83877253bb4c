"""The image repository, in a stack of its own that deploys before the training stack.

CDK publishes image assets to the stack synthesizer's repository; by default that is the CDK
bootstrap repository, which has no lifecycle rule and which `cdk destroy` never empties. The
training stack's synthesizer names this repository instead
(`DefaultStackSynthesizer(image_assets_repository_name=...)`, infra/stack.py), so:

- both images (trainer, rendezvous store) and anything CI pushes live here, under a lifecycle
  policy that never expires an image the stack runs;
- `make destroy` (`cdk destroy --all`) deletes the repository with its images (EmptyOnDelete);
- the CDK CLI publishes a stack's assets only after the stacks it depends on are deployed
  (aws-cdk toolkit-lib, work-graph-builder: an asset's publish step inherits its stack's
  dependencies), so the repository exists before the first push.

The bootstrap's image-publishing role may push only to the bootstrap repository (its policy
names that repository's ARN: aws-cdk bootstrap-template.yaml, ImagePublishingRoleDefaultPolicy):
this repository's policy lets it push here.
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import DefaultStackSynthesizer, Duration, Fn, RemovalPolicy, Stack
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_iam as iam
from constructs import Construct

from infra.config import ImageConfig

# Images kept beyond the ones the stack runs: older trainer images for Jobs still running them.
KEEP_IMAGES = 20
# What cdk-assets calls on the destination repository (the bootstrap policy's list).
PUBLISH_ACTIONS = (
    "ecr:PutImage",
    "ecr:InitiateLayerUpload",
    "ecr:UploadLayerPart",
    "ecr:CompleteLayerUpload",
    "ecr:BatchCheckLayerAvailability",
    "ecr:DescribeRepositories",
    "ecr:DescribeImages",
    "ecr:BatchGetImage",
    "ecr:GetDownloadUrlForLayer",
)


def image_publishing_role_arn() -> str:
    """The CDK bootstrap's image-publishing role in the deploying account and region."""
    return Fn.sub(
        DefaultStackSynthesizer.DEFAULT_IMAGE_ASSET_PUBLISHING_ROLE_ARN.replace(
            "${Qualifier}", DefaultStackSynthesizer.DEFAULT_QUALIFIER
        )
    )


def lifecycle_rules(*, running_tags: Sequence[str]) -> list[ecr.LifecycleRule]:
    """Expire untagged layers after a day and all but the newest KEEP_IMAGES images, never the
    images the stack runs: an image that matches a higher-priority rule's tags is not expired
    by a lower-priority rule (ECR user guide, "Lifecycle policy evaluation rules")."""
    rules = []
    if running_tags:
        rules.append(
            ecr.LifecycleRule(
                rule_priority=1,
                description="the images the stack runs",
                tag_status=ecr.TagStatus.TAGGED,
                tag_pattern_list=list(running_tags),
                max_image_count=len(running_tags),
            )
        )
    rules += [
        ecr.LifecycleRule(
            rule_priority=2,
            description="layers of unfinished pushes",
            tag_status=ecr.TagStatus.UNTAGGED,
            max_image_age=Duration.days(1),
        ),
        ecr.LifecycleRule(
            rule_priority=3,
            description=f"the newest {KEEP_IMAGES} other images",
            tag_status=ecr.TagStatus.ANY,
            max_image_count=KEEP_IMAGES,
        ),
    ]
    return rules


class ImagesStack(Stack):
    """Attribute: `repository`."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ImageConfig,
        running_tags: Sequence[str],
        **kwargs,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self.repository = ecr.Repository(
            self,
            "Repository",
            repository_name=config.repository_name,
            image_scan_on_push=True,
            # A tag always names the same image: a restarted pod never runs different code.
            image_tag_mutability=ecr.TagMutability.IMMUTABLE,
            # KMS (the AWS-managed aws/ecr key) rather than AES256: the IaC scan's CKV_AWS_136.
            encryption=ecr.RepositoryEncryption.KMS,
            lifecycle_rules=lifecycle_rules(running_tags=running_tags),
            removal_policy=RemovalPolicy.DESTROY,
            empty_on_delete=True,
        )
        self.repository.add_to_resource_policy(
            iam.PolicyStatement(
                sid="CdkImagePublishing",
                principals=[iam.ArnPrincipal(image_publishing_role_arn())],
                actions=list(PUBLISH_ACTIONS),
            )
        )
