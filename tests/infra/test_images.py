"""The trainer's image (infra/images.py): the repository, its lifecycle and the image asset.

Run with the rest of the infra tests (the stack is synthesized once per session, tests/infra/
conftest.py); the assertion helpers and their conventions are in infra_template.py.
"""

from __future__ import annotations

import json
from typing import Any

from aws_cdk.assertions import Capture, Match, Template
from infra_synth import CDK_JSON_CONTEXT, VARIANT_CONTEXT
from infra_template import (
    only_one_has,
)


def test_image_repository_and_asset(
    default_assertions: Template, variant_assertions: Template, images_template: dict[str, Any]
) -> None:
    """Both images go to the images stack's repository (infra/images.py), not CDK's bootstrap
    repository; it is emptied and deleted on destroy, and its lifecycle keeps what runs."""
    from infra.images import KEEP_IMAGES, PUBLISH_ACTIONS

    images = Template.from_json(images_template)
    name = CDK_JSON_CONTEXT["imageRepositoryName"]
    policy = Capture()
    only_one_has(
        images,
        "AWS::ECR::Repository",
        {
            "RepositoryName": name,
            "ImageTagMutability": "IMMUTABLE",
            "ImageScanningConfiguration": Match.exact({"ScanOnPush": True}),
            "EmptyOnDelete": True,
            "LifecyclePolicy": {"LifecyclePolicyText": policy},
            "RepositoryPolicyText": {
                "Statement": [
                    {
                        "Action": list(PUBLISH_ACTIONS),
                        "Principal": {
                            "AWS": {
                                "Fn::Sub": Match.string_like_regexp(
                                    "cdk-hnb659fds-image-publishing-role"
                                )
                            }
                        },
                    }
                ]
            },
        },
    )
    images.has_resource("AWS::ECR::Repository", {"DeletionPolicy": "Delete"})
    rules = json.loads(policy.as_string())["rules"]
    running = rules[0]["selection"]
    image = Capture()
    default_assertions.has_output("ImageUri", {"Value": image})
    trainer_tag = json.dumps(image.as_object()).rsplit(":", 1)[1].strip('"}')
    # The trainer's, the rendezvous store's and the node fencer's.
    assert trainer_tag in running["tagPatternList"] and running["countNumber"] == 3
    assert rules[-1]["selection"] == {
        "tagStatus": "any",
        "countType": "imageCountMoreThan",
        "countNumber": KEEP_IMAGES,
    }
    assert f"/{name}:" in json.dumps(image.as_object())
    assert "container-assets" not in json.dumps(default_assertions.to_json())
    default_assertions.resource_count_is("AWS::ECR::Repository", 0)
    variant_assertions.has_output("ImageUri", {"Value": VARIANT_CONTEXT["imageUri"]})
