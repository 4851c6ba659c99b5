"""The JSON bodies the API takes, as pydantic models, and one way to read them: a bad body is a
400 naming the first field at fault and what it must be."""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from aiohttp import web
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

__all__ = ["BadBody", "OfferBody", "PlaceCallBody", "read_body"]

Body = TypeVar("Body", bound="_Body")


class BadBody(ValueError):
    """A request body that does not fit its model; the message is the client's error text."""


def _readable_text(text: str) -> str:
    if not text.strip():
        raise ValueError("must be a non-empty string")
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate escape such as "\ud800"
        raise ValueError("must be valid Unicode text") from None
    return text


class _Body(BaseModel):
    """A request body: strict types (no "3" for 3), unknown keys ignored. Each field's
    description says what it must be, for the error text."""

    model_config = ConfigDict(strict=True, extra="ignore")


class OfferBody(_Body):
    """``POST /offer``: a WebRTC offer, and the playbook to call."""

    sdp: Annotated[str, AfterValidator(_readable_text)] = Field(description="a non-empty string")
    type: Literal["offer"] = Field(description='"offer"')
    playbook: str | None = Field(default=None, description="a string id")


class PlaceCallBody(_Body):
    """``POST /calls``: the SIP URI (or a number, with a trunk) to call, the playbook, the
    trunk, and how long it may ring."""

    to: str = Field(
        description="a SIP URI string, e.g. sip:alice@192.0.2.7:5060, or a number the trunk "
        "calls at its host"
    )
    playbook: str | None = Field(default=None, description="a string id")
    trunk: str | None = Field(default=None, description="a trunk name (--sip-trunks)")
    ring_timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=600,
        allow_inf_nan=False,
        description="a number of seconds in (0, 600]",
    )


EXAMPLES: dict[type[_Body], str] = {
    OfferBody: '{"sdp": ..., "type": "offer"}',
    PlaceCallBody: '{"to": "sip:user@host", "playbook": ...}',
}


async def read_body(request: web.Request, model: type[Body]) -> Body:
    """``request``'s JSON body as ``model``; raises BadBody with what is wrong."""
    try:
        data = await request.json()
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise BadBody(f"the body must be JSON: {EXAMPLES[model]}") from None
    if not isinstance(data, dict):
        raise BadBody("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise BadBody(_first_problem(model, exc)) from None


def _first_problem(model: type[_Body], exc: ValidationError) -> str:
    error = exc.errors(include_url=False)[0]
    name = str(error["loc"][0]) if error["loc"] else "body"
    if error["type"] == "value_error":
        return f"{name} {error['ctx']['error']}"
    field = model.model_fields.get(name)
    wanted = field.description if field is not None and field.description else "valid"
    return f"{name} must be {wanted}"
