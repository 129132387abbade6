"""Typed errors → each protocol's status and JSON, judged by the SDKs' exception classes."""

from __future__ import annotations

import anthropic
import openai
import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from engine.offload import BudgetError
from gateway.errors import (
    EXCEPTION_HANDLERS,
    BadRequest,
    ContextLengthExceeded,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    ShuttingDown,
    Unauthorized,
    error_body,
    error_event,
    status_of,
    typed,
)
from tests.gateway.test_out_support import LoopbackServer, Script, make_app

ANTHROPIC_REQUEST = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
CHAT_REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def url():
    with LoopbackServer(make_app()) as base:
        yield base
    Script.error = None


CASES = [
    (
        BadRequest("messages[0].content", "expected a string"),
        anthropic.BadRequestError,
        openai.BadRequestError,
    ),
    (ContextLengthExceeded(9000, 8192), anthropic.BadRequestError, openai.BadRequestError),
    (Unauthorized(), anthropic.AuthenticationError, openai.AuthenticationError),
    (NotFound("model m"), anthropic.NotFoundError, openai.NotFoundError),
    (PayloadTooLarge(10, 5), anthropic.RequestTooLargeError, openai.APIStatusError),
    (Overloaded(), anthropic.OverloadedError, openai.RateLimitError),
    (RuntimeError("secret detail"), anthropic.InternalServerError, openai.InternalServerError),
]


@pytest.mark.parametrize(("exc", "anthropic_cls", "openai_cls"), CASES)
def test_sdks_raise_the_matching_exception(url, exc, anthropic_cls, openai_cls):
    Script.error = exc
    with pytest.raises(anthropic_cls) as a:
        anthropic.Anthropic(base_url=url, api_key="k", max_retries=0).messages.create(**ANTHROPIC_REQUEST)
    assert a.value.body["error"] == error_body("anthropic", exc)["error"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai_cls) as o:
        client.chat.completions.create(**CHAT_REQUEST)
    assert o.value.code == error_body("openai", exc)["error"]["code"]
    with pytest.raises(openai_cls):
        client.responses.create(model="m", input="hi")
    Script.error = None


def test_bad_request_names_the_field_as_param():
    err = error_body("openai", BadRequest("input[3].type", "unknown item type"))["error"]
    assert (err["param"], err["type"]) == ("input[3].type", "invalid_request_error")


def test_context_length_wording_per_client_family():
    exc = ContextLengthExceeded(9000, 8192)
    assert (
        error_body("anthropic", exc)["error"]["message"] == "prompt is too long: 9000 tokens > 8192 maximum"
    )
    assert error_body("openai", exc)["error"]["code"] == "context_length_exceeded"
    assert error_event("openai", exc).kind == "context_length_exceeded"


def test_internal_errors_do_not_leak_their_message():
    assert "secret" not in error_body("openai", RuntimeError("secret"))["error"]["message"]


def test_a_forward_the_memory_budget_cannot_hold_is_out_of_device_memory_with_its_numbers():
    """A BudgetError in a step (the expert slots and the kept sequences could not make room) is a
    retryable busy server naming the budget, not an internal error."""
    exc = typed(BudgetError("--gpu-memory 8.000 GiB: a forward's 1.597 GiB leave room for 0 experts per layer"))
    assert status_of("openai", exc) == 503
    body = error_body("openai", exc)["error"]
    assert body["code"] == "out_of_device_memory" and "--gpu-memory 8.000 GiB" in body["message"]


def test_subclass_maps_like_its_base():
    class ModelNotFound(NotFound):
        pass

    assert error_body("anthropic", ModelNotFound("x"))["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (ContextLengthExceeded(9000, 8192), 400),
        (Overloaded(), None),
        (ShuttingDown(), 503),
        (RuntimeError("x"), 500),
    ],
)
def test_raised_errors_are_answered_in_the_paths_protocol(exc, status):
    """The handlers registered on an app turn what a route raises into the JSON of the protocol its
    path belongs to; an unknown route is a 404 in the same shape."""

    async def fail(request):
        raise exc

    app = Starlette(
        routes=[Route(path, fail, methods=["POST"]) for path in ("/v1/messages", "/v1/chat/completions")],
        exception_handlers=EXCEPTION_HANDLERS,
    )
    with TestClient(app, raise_server_exceptions=False) as client:
        anthropic_style = client.post("/v1/messages")
        openai_style = client.post("/v1/chat/completions")
        missing = client.get("/v1/messages/nothing")
    assert anthropic_style.status_code == status_of("anthropic", exc) == (status or 529)
    assert anthropic_style.json() == error_body("anthropic", exc)
    assert openai_style.status_code == status_of("openai", exc) == (status or 429)
    assert openai_style.json() == error_body("openai", exc)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
