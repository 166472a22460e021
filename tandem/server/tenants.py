"""Tenants by API key: who a request is, for the key check, the prefix cache's namespace and the logs.

Each key is a tenant with a name: `--api-key KEY` (repeatable; named key1, key2, ... or "default" when it is the
only one), `--api-key-file FILE` (one `name:key` a line; blank lines and `#` comments skipped) and, when neither is
given, `$TANDEM_API_KEY` ("default"). A request presents its key as `Authorization: Bearer KEY` or `x-api-key:
KEY`; the header's bytes are compared with each key's UTF-8 bytes in constant time (`hmac.compare_digest`), so a
non-ASCII key sent by curl or an SDK (which send UTF-8) matches.

A tenant's requests without a `cache_salt` share a prefix-cache namespace of their own (`tenant_salt`), so one
tenant cannot learn from cached-token counts or latency whether another sent a prompt; a request's own
`cache_salt` picks its namespace instead (two tenants sending the same salt share one). A salt beginning with
U+0000 is refused: that prefix is the tenants' own. The name, never the key, reaches the request log line.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence
from pathlib import Path

from starlette.requests import HTTPConnection

from tandem.server.errors import APIError, invalid

TENANT_SALT_PREFIX = "\x00tenant:"
MAX_SALT_CHARS = 1024  # a salt is written into every disk block's header: bounded like any per-request size


def parse_keys(keys: Sequence[str], key_file: str | None, env_key: str | None) -> dict[str, str]:
    """Tenant name -> key from the flags (see the module docstring); {} when no key is set (an open server).

    Raises: ValueError for an unreadable `key_file`, a line of it that is not `name:key`, or a name used twice.
    """
    found: list[tuple[str, str]] = []
    for i, key in enumerate(keys):
        found.append((f"key{i + 1}", key))
    if key_file is not None:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the key file {key_file}: {exc}") from exc
        for n, line in enumerate(lines, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            name, sep, key = text.partition(":")
            if not sep or not name.strip() or not key.strip():
                raise ValueError(f"{key_file}:{n}: expected 'name:key'")
            found.append((name.strip(), key.strip()))
    if not found and env_key:
        found.append(("default", env_key))
    if len(found) == 1 and not key_file:
        found = [("default", found[0][1])]
    tenants: dict[str, str] = {}
    for name, key in found:
        if not key:
            raise ValueError(f"the key of tenant '{name}' is empty")
        if name in tenants:
            raise ValueError(f"the tenant name '{name}' is given twice")
        tenants[name] = key
    return tenants


def request_key(request: HTTPConnection) -> bytes | None:
    """The key a request presents, as the header's bytes: `x-api-key`, else the `Authorization: Bearer` token,
    else None. (Starlette decodes header bytes as Latin-1, so encoding back as Latin-1 gives them unchanged.)"""
    key = request.headers.get("x-api-key")
    if key:
        return key.encode("latin-1")
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token.encode("latin-1") if scheme.lower() == "bearer" and token else None


def check_tenant(request: HTTPConnection, tenants: Mapping[str, str]) -> str | None:
    """The name of the tenant whose key the request presents; None when the server takes no key.

    Raises: APIError 401 code "invalid_api_key" when keys are set and none matches (each key compared in
    constant time, every key every time)."""
    if not tenants:
        return None
    given = request_key(request)
    match = None
    for name, key in tenants.items():
        if given is not None and hmac.compare_digest(given, key.encode("utf-8")) and match is None:
            match = name
    if match is None:
        raise APIError(401, "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)",
                       code="invalid_api_key")
    return match


def tenant_salt(salt: str | None, tenant: str | None) -> str | None:
    """The prefix-cache namespace of a request: its own `cache_salt`, else its tenant's, else None (shared).

    Raises: APIError 400 for a salt that begins with U+0000 (the tenants' prefix) or is over MAX_SALT_CHARS."""
    if salt is not None:
        if salt.startswith("\x00"):
            raise invalid("cache_salt", "'cache_salt' may not begin with U+0000")
        if len(salt) > MAX_SALT_CHARS:
            raise invalid("cache_salt", f"'cache_salt' may hold at most {MAX_SALT_CHARS} characters")
        return salt
    return TENANT_SALT_PREFIX + tenant if tenant is not None else None
