"""read_api_key: the smoke test's key from spec.auth.apiKeySecret, or a refusal naming the Secret and key."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from headroom.operator.api_key import ApiKeyUnavailable, read_api_key
from headroom.operator.spec import parse_spec

from tests.operator.resources import inference_server


class FakeKube:
    def __init__(self, objects: dict[str, dict[str, Any]]):
        self.objects = objects

    def get(self, path: str) -> dict[str, Any] | None:
        return self.objects.get(path)


PATH = "/api/v1/namespaces/llm/secrets/engine-key"
SPEC = parse_spec(inference_server(auth={"apiKeySecret": {"name": "engine-key", "key": "token"}})["spec"])


def test_the_key_is_decoded_from_the_secret() -> None:
    kube = FakeKube({PATH: {"data": {"token": base64.b64encode(b"s3cret\n").decode()}}})
    assert read_api_key(kube, "llm", SPEC) == "s3cret"  # type: ignore[arg-type]
    assert read_api_key(kube, "llm", parse_spec(inference_server()["spec"])) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("objects, reason", [
    ({}, "the Secret does not exist"),
    ({PATH: {"data": {"other": "eA=="}}}, "the Secret has no such key"),
    ({PATH: {"data": {"token": "not base64!"}}}, "not base64-encoded UTF-8"),
    ({PATH: {"data": {"token": ""}}}, "the key is empty"),
])
def test_a_missing_or_broken_secret_is_named(objects: dict, reason: str) -> None:
    with pytest.raises(ApiKeyUnavailable) as error:
        read_api_key(FakeKube(objects), "llm", SPEC)  # type: ignore[arg-type]
    assert "Secret llm/engine-key key 'token' (spec.auth.apiKeySecret)" in str(error.value) and reason in str(error.value)


def test_the_spec_names_a_bad_auth_field() -> None:
    from headroom.operator.spec import SpecError

    with pytest.raises(SpecError, match="spec.auth.apiKeySecret.name"):
        parse_spec(inference_server(auth={"apiKeySecret": {"name": ""}})["spec"])
