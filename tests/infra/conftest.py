"""Fixtures for the infra tests: the stack is synthesized once per configuration per session.

Helpers live in infra_synth.py (a unique module name: tests/conftest.py is also `conftest`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from aws_cdk.assertions import Template
from cfn_emulator import offline_environ
from infra_synth import VARIANT_CONTEXT, synth


@pytest.fixture(scope="session", autouse=True)
def no_aws_from_tests() -> Iterator[None]:
    """Nothing a test runs can reach AWS: app.py, the CDK CLI and the AWS CLI read the deployed
    stack (infra/deployed.py), and a developer's or CI's credentials would make those real calls.
    Every AWS_* variable of the inherited environment is dropped and the CLI is given no
    credentials, no config files, no instance metadata and a closed local port as its endpoint
    (the emulator, tests/infra/cfn_emulator.py, sets its own endpoint and dummy keys on top).
    Session-wide, so the session fixtures' synths and every subprocess inherit it."""
    with pytest.MonkeyPatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("AWS_")]:
            patch.delenv(key)
        for key, value in offline_environ({}).items():
            patch.setenv(key, value)
        yield


@pytest.fixture(scope="session")
def default_app(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Any]:
    """The training stack's template of cdk.json's defaults, and its (synthesized) app."""
    return synth(outdir=tmp_path_factory.mktemp("cdk-default"))


@pytest.fixture(scope="session")
def default_template(default_app: tuple[dict[str, Any], Any]) -> dict[str, Any]:
    """The template of cdk.json's defaults."""
    return default_app[0]


@pytest.fixture(scope="session")
def images_template(default_app: tuple[dict[str, Any], Any]) -> dict[str, Any]:
    """The images stack's template (infra/images.py) of cdk.json's defaults."""
    from infra.stack import IMAGES_STACK_NAME

    return default_app[1].synth().get_stack_by_name(IMAGES_STACK_NAME).template


@pytest.fixture(scope="session")
def variant_template(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The template of VARIANT_CONTEXT."""
    return synth(VARIANT_CONTEXT, outdir=tmp_path_factory.mktemp("cdk-variant"))[0]


# The same two templates for aws_cdk.assertions: built from the dicts above, so no extra synth
# (the snapshots, cfn-lint and infra.nag's own checks read the plain dicts).
@pytest.fixture(scope="session")
def default_assertions(default_template: dict[str, Any]) -> Template:
    return Template.from_json(default_template)


@pytest.fixture(scope="session")
def variant_assertions(variant_template: dict[str, Any]) -> Template:
    return Template.from_json(variant_template)
