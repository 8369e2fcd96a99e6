"""Tenants: who may submit, read and cancel what (issue 45).

Off unless --tenants-file (KERNELEVAL_TENANTS_FILE) names a file: then every KernelEvalService
call carries `authorization: Bearer <token>`, a tenant's token or the admin token, checked in
TenantAuth (a server interceptor, as AdminAuth is) before the servicer runs. A tenant sees only
its own jobs (the servicer scopes GetJob, ListJobs, Watch, CancelJob and the streams by
`caller`); the admin token sees every job. The file holds one line per token,
`tenant-name:sha256-hex-of-token` (blank lines and `#` comments skipped): tokens are stored
hashed (`kerneleval tenant-token NAME` makes one). The file is read at start and again on
SIGHUP (a file that does not parse then leaves the tokens as they were, and the log says why):
a token taken out of the file is refused from then on.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

from kerneleval_server.api.auth import Handler, Interceptor, refused_handler

log = logging.getLogger("kerneleval.tenants")

JOB_SERVICE = "/kerneleval.v1.KernelEvalService/"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
HEX = re.compile(r"[0-9a-f]{64}")
MISSING = (
    "this service has tenants: KernelEvalService needs the metadata "
    "'authorization: Bearer <tenant token>' (kerneleval --tenant-token, env "
    "KERNELEVAL_TENANT_TOKEN), or the admin token"
)
WRONG = "the token given is no tenant's of this service (nor its admin token), or was revoked"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(name: str) -> tuple[str, str]:
    """A fresh token for tenant `name` and its line for the tenants file."""
    if not NAME.fullmatch(name):
        raise ValueError(f"tenant name {name!r}: letters, digits, '_', '.', '-' (1-64)")
    token = "ket_" + secrets.token_urlsafe(32)
    return token, f"{name}:{hash_token(token)}"


def parse(text: str, where: str = "tenants file") -> dict[str, str]:
    """hash -> tenant name, from a tenants file's text; ValueError names a bad line."""
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, digest = line.partition(":")
        name, digest = name.strip(), digest.strip().lower()
        if not sep or not NAME.fullmatch(name) or not HEX.fullmatch(digest):
            raise ValueError(
                f"{where}:{n}: not 'tenant-name:sha256-hex-of-token' "
                "(kerneleval tenant-token NAME prints a line)"
            )
        out[digest] = name
    return out


class Tenants:
    """The tenants of a service (`path` None: off) and the admin token, which sees all."""

    def __init__(self, path: str | Path | None, admin_token: str = "") -> None:
        self.path = Path(path) if path else None
        self._admin = admin_token.encode()
        self._by_hash: dict[str, str] = {}
        if self.path is not None:
            self._by_hash = parse(self.path.read_text(encoding="utf-8"), str(self.path))
            log.info("tenants on: %d token(s) from %s", len(self._by_hash), self.path)

    @property
    def on(self) -> bool:
        return self.path is not None

    def reload(self) -> bool:
        """Reads the file again (SIGHUP); on an error keeps the tokens as they were."""
        if self.path is None:
            return False
        try:
            self._by_hash = parse(self.path.read_text(encoding="utf-8"), str(self.path))
        except (OSError, ValueError) as exc:
            log.error("tenants file not reloaded, the tokens stay as they were: %s", exc)
            return False
        log.info("tenants reloaded: %d token(s) from %s", len(self._by_hash), self.path)
        return True

    def resolve(self, metadata: Iterable[tuple[str, Any]] | None) -> tuple[str | None, str]:
        """(the caller's scope, why refused): scope None sees every job (tenants off, or the
        admin token), else the tenant's name; a refusal ("" when none) is a message."""
        if not self.on:
            return None, ""
        given = False
        for key, value in metadata or ():
            if key.lower() != "authorization":
                continue
            scheme, _, text = str(value).partition(" ")
            if scheme.lower() != "bearer":
                continue
            given = True
            token = text.strip()
            if self._admin and hmac.compare_digest(token.encode(), self._admin):
                return None, ""
            name = self._by_hash.get(hash_token(token))
            if name is not None:
                return name, ""
        return None, WRONG if given else MISSING


class TenantAuth(Interceptor):
    """Refuses a KernelEvalService call without a valid token (UNAUTHENTICATED) when tenants
    are on; does nothing when they are off."""

    def __init__(self, tenants: Tenants) -> None:
        self._tenants = tenants

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(details)
        method = getattr(details, "method", "") or ""
        if handler is None or not self._tenants.on or not method.startswith(JOB_SERVICE):
            return handler
        _, why = self._tenants.resolve(getattr(details, "invocation_metadata", None))
        return handler if not why else refused_handler(handler, why)
