"""Prefix-cache isolation: the salt every HTTP and gRPC request is queued with.

Cached prompt blocks are shared only between requests with equal salts (the block hash
takes the salt as extra keys, `engine.core.kv_cache.hashing`), so `cached_tokens` tells a
client nothing about prompts sent under another salt. A client may pick a salt per request
(`cache_salt`, as in vLLM); with `server.cache_salt_by_api_key` the server also salts by the
caller's API key, so two keys never share however they pick their salts. The key itself is
never kept: its salt is a hash of it.
"""

from __future__ import annotations

import hashlib


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
