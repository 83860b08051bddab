"""API keys and tenants for ``verispec serve``.

A server started with keys (``--api-key KEY``, ``--api-keys-file FILE``) answers every
request under ``/v1/`` without a valid ``Authorization: Bearer KEY`` header with 401 in
OpenAI's error shape, before the body is read: nothing reaches the model. A valid key
names its tenant (``request.state.tenant``), the identity per-tenant state is kept
under. ``/health`` and ``/metrics`` stay open (probes and scrapers carry no key).
Without keys every request is the tenant ``"default"``.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Mapping
from typing import Optional

__all__ = ["DEFAULT_TENANT", "ApiKeys", "read_keys_file"]

DEFAULT_TENANT = "default"
PROTECTED_PREFIX = "/v1/"


def _check_key(key: object, where: str) -> str:
    if not isinstance(key, str) or not key or any(c.isspace() for c in key):
        raise ValueError(f"{where}: an API key must be a non-empty string without spaces, "
                         f"got {key!r}")
    return key


def read_keys_file(path: str | os.PathLike) -> dict[str, str]:
    """Keys and their tenants from a file: a JSON object {"KEY": "TENANT", ...}, or lines
    "KEY TENANT" ("KEY" alone: the tenant is the key's own line number, "tenant-N"),
    blank lines and lines starting with '#' skipped. ValueError naming the line."""
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    keys: dict[str, str] = {}
    if text.lstrip().startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: expected a JSON object of key -> tenant, got invalid "
                             f"JSON ({e})") from None
        for key, tenant in raw.items():
            if not isinstance(tenant, str) or not tenant:
                raise ValueError(f"{path}: the tenant of a key must be a non-empty string, "
                                 f"got {tenant!r}")
            keys[_check_key(key, path)] = tenant
    else:
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) > 2:
                raise ValueError(f"{path}, line {n}: expected 'KEY' or 'KEY TENANT', got "
                                 f"{len(parts)} fields")
            key = _check_key(parts[0], f"{path}, line {n}")
            if key in keys:
                raise ValueError(f"{path}, line {n}: the key is listed twice")
            keys[key] = parts[1] if len(parts) == 2 else f"tenant-{n}"
    if not keys:
        raise ValueError(f"{path}: expected at least one key, got none")
    return keys


class ApiKeys:
    """The keys a server accepts, each with its tenant (empty: no keys, every request
    is DEFAULT_TENANT)."""

    def __init__(self, keys: Optional[Mapping[str, str]] = None) -> None:
        self._keys = {_check_key(k, "ApiKeys"): str(t) for k, t in (keys or {}).items()}

    def __bool__(self) -> bool:
        return bool(self._keys)

    @property
    def tenants(self) -> set[str]:
        return set(self._keys.values())

    def tenant(self, authorization: Optional[str]) -> Optional[str]:
        """The tenant of an Authorization header's bearer key; None when it is missing or
        not a key (every key compared in constant time)."""
        if not self._keys:
            return DEFAULT_TENANT
        if not authorization:
            return None
        scheme, _, given = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return None
        given_b = given.strip().encode()
        found = None
        for key, tenant in self._keys.items():
            if hmac.compare_digest(key.encode(), given_b):
                found = tenant
        return found
