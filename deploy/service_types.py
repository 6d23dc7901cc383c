"""What the gateway and the router service exchange: requests, results, errors.

Errors carry the HTTP status the gateway answers with and pickle across Ray.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from wasma.deploy.metadata import WorkflowIdentity
from wasma.engines.base import EngineCall

# -- errors (mapped to HTTP statuses by the gateway; picklable across Ray) -------------


class ServiceError(Exception):
    status = 500
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.param, self.retry_after_s))


class BadRequest(ServiceError):
    status = 400


class NotFound(ServiceError):
    status = 404
    code = "not_found"


class Conflict(ServiceError):
    status = 409
    code = "conflict"


class Overloaded(ServiceError):
    status = 429
    code = "overloaded"


class Unavailable(ServiceError):
    status = 503
    code = "no_healthy_engine"


# -- requests and results ------------------------------------------------------------


@dataclass(slots=True)
class ServiceRequest:
    """One request as the gateway hands it to the router (already tokenised)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    identity: WorkflowIdentity = field(default_factory=WorkflowIdentity)
    tenant: str = ""  # workflow ids are scoped per API key ("" when the gateway is open)
    temperature: float = 0.0
    ignore_eos: bool = False
    extra: dict[str, object] = field(default_factory=dict)
    # The client's API request, for engines that answer it themselves (pass-through).
    call: EngineCall | None = None
    # The engine (by name) that must serve it, whatever the policy prefers.
    pin_engine: str | None = None


@dataclass(slots=True)
class ServiceResult:
    """A finished non-streamed request."""

    engine: str
    kind: str
    token_ids: list[int]
    finish_reason: str | None
    cached_tokens: int
    text: str = ""
    raw: bytes = b""  # a passed-through answer's body, and its HTTP status
    status: int = 0
    stop_reason: int | str | None = None


def tenant_of(api_key: str | None) -> str:
    """A short, stable, non-reversible tenant id for an API key ("" when open)."""
    if not api_key:
        return ""
    return hashlib.blake2b(api_key.encode(), digest_size=6).hexdigest()
