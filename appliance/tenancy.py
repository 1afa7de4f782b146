"""Who a request is for: its tenant, its deadline and its prefix-cache salt, decided once
for HTTP and gRPC alike.

Tenants (`server.tenants`): an API key belongs to at most one tenant; a key under none, and
every request when keys are off, belongs to `default`. `Tenancy.caller` turns what a
frontend read from the call (the bearer key, the timeout the client asked for) into a
`Caller`: the engine `Tenant` (name, weight, limits: what the scheduler reads), the
request's deadline on the engine's clock, and the tenant's cache salt. This is the one
place the appliance says which tenant a request belongs to: `Tenancy.tenant_of(api_key)`.

Prefix-cache isolation. Cached prompt blocks are shared only between requests with equal
salts (the block hash takes the salt as extra keys, `engine.core.kv_cache.hashing`), so
`cached_tokens` tells a client nothing about prompts sent under another salt. A client may
pick a salt per request (`cache_salt`, as in vLLM); with `server.cache_salt_by_api_key` the
server also salts by the caller's API key, so two keys never share however they pick their
salts; with `server.cache_salt_by_tenant`, by the caller's tenant (its keys share, other
tenants do not). The key itself is never kept: its salt is a hash of it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from appliance.config.schema import ServerConfig
from engine import Tenant
from engine.errors import InvalidRequestError

DEFAULT_TENANT = "default"


def api_key_salt(api_key: str | bytes) -> str:
    """A stand-in for `api_key` in block hashes (a hash: the key is not stored anywhere)."""
    raw = api_key.encode() if isinstance(api_key, str) else api_key
    return hashlib.sha256(b"appliance cache_salt by api key\0" + raw).hexdigest()


def request_cache_salt(
    user_salt: str | None, api_key: str | bytes | None, by_api_key: bool
) -> tuple[str, ...]:
    """The engine's `cache_salt` (extra keys of the block hash): the key's salt first when
    salting by API key, then the client's own. Equal tuples share cached blocks; a client's
    salt can never equal another key's tuple, which always starts with that key's hash."""
    keys: list[str] = []
    if by_api_key and api_key is not None:
        keys.append(api_key_salt(api_key))
    if user_salt is not None:
        keys.append(user_salt)
    return tuple(keys)


def response_owner(api_key: str | bytes | None) -> str:
    """Who owns a stored response (the Responses API's `store`): a hash of the API key that
    created it, or "" for a server without keys. The one place ownership is decided (HTTP
    and gRPC alike): tenants (issue 26, `server.tenants`) are not in this build yet; when
    they are, mapping the key to its tenant here makes every stored response follow."""
    if api_key is None:
        return ""
    raw = api_key.encode() if isinstance(api_key, str) else api_key
    return hashlib.sha256(b"appliance response owner\0" + raw).hexdigest()


def tenant_salt(name: str) -> str:
    """A tenant's prefix-cache salt (a hash of its name, distinct from any key's salt)."""
    return hashlib.sha256(b"appliance cache_salt by tenant\0" + name.encode()).hexdigest()


def parse_timeout(value: str | float, field: str) -> float:
    """Seconds from a request's timeout field; InvalidRequestError (a 400 / INVALID_ARGUMENT
    naming `field`) unless it is a positive finite number."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds <= 0:
        raise InvalidRequestError(
            f"{field} must be a positive, finite number of seconds, got {value!r}", field
        )
    return seconds


@dataclass(frozen=True)
class Caller:
    """What the engine is told about who sent a request."""

    tenant: Tenant
    deadline: float | None  # time.monotonic() by which it must finish; None: no deadline
    salt: tuple[str, ...]  # the tenant's prefix-cache salt (empty unless by tenant)


class Tenancy:
    """API key -> tenant, built once from the `server` section."""

    def __init__(self, server: ServerConfig):
        self._by_key: dict[str, Tenant] = {}
        self._tenants: dict[str, Tenant] = {DEFAULT_TENANT: Tenant(DEFAULT_TENANT)}
        for name, t in server.tenants.items():
            tenant = Tenant(
                name,
                weight=t.weight,
                max_running=t.max_running,
                max_queued=t.max_queued,
                tokens_per_minute=t.tokens_per_minute,
            )
            self._tenants[name] = tenant
            for key in t.keys:
                self._by_key[key] = tenant
        self._default = self._tenants[DEFAULT_TENANT]
        self._salt_by_tenant = server.cache_salt_by_tenant
        self._default_timeout_s = server.default_request_timeout_s

    @property
    def names(self) -> list[str]:
        """Every tenant a request can belong to (`default` included): the bounded set of
        values of the metrics' `tenant` label."""
        return list(self._tenants)

    def tenant_of(self, api_key: str | bytes | None) -> Tenant:
        """The tenant a (checked) API key belongs to; `default` for none or an unlisted key."""
        if api_key is None:
            return self._default
        key = api_key.decode() if isinstance(api_key, bytes) else api_key
        return self._by_key.get(key, self._default)

    def caller(
        self, api_key: str | bytes | None, timeout_s: float | None, arrival: float
    ) -> Caller:
        """`timeout_s`: what the request asked for (None: server.default_request_timeout_s),
        counted from `arrival` (time.monotonic())."""
        tenant = self.tenant_of(api_key)
        timeout = timeout_s if timeout_s is not None else self._default_timeout_s
        deadline = None if timeout is None else arrival + timeout
        salt = (tenant_salt(tenant.name),) if self._salt_by_tenant else ()
        return Caller(tenant, deadline, salt)
