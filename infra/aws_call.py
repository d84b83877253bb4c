"""One SigV4-signed HTTPS call to an AWS API, for the operator tools (`make alert-test`,
`python -m infra.addon_versions check`) and the node fencer (infra/fencer).

Signed by `awscrt` (AWS's common runtime, what boto3's CRT mode and the AWS CLI v2 sign with):
boto3/botocore cannot be installed beside `kubernetes` (botocore pins python-dateutil<3,
kubernetes needs >=3). Credentials: the usual chain (environment, shared profile, process,
container, instance); for an SSO profile run `eval "$(aws configure export-credentials
--format env)"` first.
"""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class AwsCallError(Exception):
    """A call failed; the message names the request and AWS's answer."""


def signed_request(
    method: str,
    url: str,
    *,
    service: str,
    region: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> Any:
    """One SigV4-signed request; the JSON answer (None when empty)."""
    text = signed_bytes(method, url, service=service, region=region, body=body, headers=headers)
    return json.loads(text) if text.strip() else None


def signed_bytes(
    method: str,
    url: str,
    *,
    service: str,
    region: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> bytes:
    """One SigV4-signed request; the answer's bytes (EC2's Query API answers XML)."""
    from awscrt import auth, http

    parts = urllib.parse.urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    all_headers = {"host": parts.netloc, **(headers or {})}
    if body:
        all_headers["content-length"] = str(len(body))
    request = http.HttpRequest(
        method, path, http.HttpHeaders(list(all_headers.items())), io.BytesIO(body)
    )
    config = auth.AwsSigningConfig(
        credentials_provider=auth.AwsCredentialsProvider.new_default_chain(),
        region=region,
        service=service,
        signed_body_header_type=auth.AwsSignedBodyHeaderType.X_AMZ_CONTENT_SHA_256,
    )
    try:
        auth.aws_sign_request(request, config).result(timeout=30)
    except Exception as err:
        raise AwsCallError(f"no AWS credentials to sign with ({err})") from None
    signed = urllib.request.Request(url, data=body or None, method=method)
    for name, value in request.headers:
        if name.lower() not in ("host", "content-length"):
            signed.add_header(name, value)
    try:
        with urllib.request.urlopen(signed, timeout=30) as response:
            text = response.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:300]
        raise AwsCallError(f"{method} {url}: HTTP {err.code} {detail}") from None
    except urllib.error.URLError as err:
        raise AwsCallError(f"{method} {url}: {err.reason}") from None
    return text
