"""Who an HTTP request is for: its tenant (by its API key), its deadline and its tenant's
cache salt, as `appliance.tenancy.Caller` (the same rule the gRPC frontend applies).

The deadline comes from the `X-Request-Timeout` header (seconds from arrival), else
`server.default_request_timeout_s`. A header that is not a positive, finite number of
seconds is a 400 naming it. When the deadline passes the engine drops the request from
the queue before any compute, or stops it at its next step if it is running: the answer
is a 504 (`deadline_exceeded`), or, on a stream already under way, an error event.

`request_tenant` is the one place the HTTP side reads a request's tenant (for anything
that stores per-tenant state, e.g. stored responses).
"""

from __future__ import annotations

from starlette.requests import Request

from appliance.http.errors import from_engine_error
from appliance.http.middleware import api_key_of
from appliance.http.serving import AppState
from appliance.tenancy import Caller, parse_timeout
from engine import Tenant

TIMEOUT_HEADER = "X-Request-Timeout"


def caller_of(request: Request, state: AppState, arrival: float) -> Caller:
    """The request's `Caller`; raises a 400 APIError for a bad X-Request-Timeout."""
    raw = request.headers.get(TIMEOUT_HEADER)
    try:
        timeout = None if raw is None else parse_timeout(raw.strip(), TIMEOUT_HEADER)
    except ValueError as e:
        raise from_engine_error(e) from None
    assert state.tenancy is not None
    return state.tenancy.caller(api_key_of(request.scope), timeout, arrival)


def request_tenant(request: Request, state: AppState) -> Tenant:
    """The tenant the request's API key belongs to (`default` without one)."""
    assert state.tenancy is not None
    return state.tenancy.tenant_of(api_key_of(request.scope))
