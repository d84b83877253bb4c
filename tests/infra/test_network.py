"""The VPC (infra/network.py): subnets per zone and encrypted flow logs.

Run with the rest of the infra tests (the stack is synthesized once per session, tests/infra/
conftest.py); the assertion helpers and their conventions are in infra_template.py.
"""

from __future__ import annotations

import json

from aws_cdk.assertions import Capture, Match, Template
from infra_template import (
    only_one_has,
    resource_has,
)


def test_vpc_layout(default_assertions: Template) -> None:
    # Distinct AZs per tier: a count over the matches, which a pattern cannot state.
    for public in (True, False):
        subnets = default_assertions.find_resources(
            "AWS::EC2::Subnet", {"Properties": {"MapPublicIpOnLaunch": public}}
        )
        assert len({s["Properties"]["AvailabilityZone"] for s in subnets.values()}) >= 2, public
    assert len(default_assertions.find_resources("AWS::EC2::NatGateway")) >= 1
    # The S3 service name is an Fn::Join over the region: look for ".s3" in its JSON.
    service_name = Capture()
    only_one_has(
        default_assertions,
        "AWS::EC2::VPCEndpoint",
        {"VpcEndpointType": "Gateway", "ServiceName": service_name},
    )
    assert ".s3" in json.dumps(service_name.as_object())
    default_assertions.resource_count_is("AWS::EC2::FlowLog", 1)


def test_flow_logs_encrypted_with_the_stacks_key(default_assertions: Template) -> None:
    key_id = Capture()
    only_one_has(
        default_assertions,
        "AWS::Logs::LogGroup",
        {"KmsKeyId": {"Fn::GetAtt": [key_id, Match.any_value()]}},
    )
    group_id = default_assertions.get_resource_id("AWS::Logs::LogGroup")
    only_one_has(
        default_assertions, "AWS::EC2::FlowLog", {"LogGroupName": Match.exact({"Ref": group_id})}
    )
    sid = "CloudWatchLogsUseOfTheKey"
    logs_statement = Match.object_like(
        {
            "Sid": sid,
            "Principal": {
                "Service": Match.exact(
                    {"Fn::Join": ["", ["logs.", {"Ref": "AWS::Region"}, ".amazonaws.com"]]}
                )
            },
            "Action": Match.array_with(["kms:GenerateDataKey*"]),
            "Condition": {"ArnLike": {"kms:EncryptionContext:aws:logs:arn": Match.any_value()}},
        }
    )
    resource_has(
        default_assertions,
        key_id.as_string(),
        "AWS::KMS::Key",
        {"KeyPolicy": {"Statement": Match.array_with([logs_statement])}},
    )
    # And it is the only statement of that Sid (array_with would accept a second one).
    key = default_assertions.find_resources("AWS::KMS::Key")[key_id.as_string()]
    statements = key["Properties"]["KeyPolicy"]["Statement"]
    assert [s.get("Sid") for s in statements].count(sid) == 1
