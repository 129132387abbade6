"""Tenants: the API keys a server accepts, each with its own namespace of checkpoints.

`--api-key-file` holds one key a line. `NAME:KEY` names a tenant (the name runs to the first
colon); `NAME:KEY:public` also opts it in to sharing the public prefix (system prompt and tools)
with the other tenants that opt in. A file of one line with no colon is one unnamed key, as
`--api-key` and `$FT_API_KEY` are: the server's own namespace, as without a key.

A named tenant's salt is HMAC-SHA256(server secret, name), derived here and never read from a
request; the secret is made once, kept 0600 in the disk cache folder (`tenant-secret`), so a
restart on the same folder finds each tenant's checkpoints again and only them. Folded into the
root anchor (`gateway.anchors.Namespace`), the salt makes every anchor, and so every checkpoint key
in RAM and on disk, the tenant's own. Each tenant also has its own token memo: a memo hit changes
how a sent message is tokenized (its prompt's token count), which would tell one tenant that
another was answered with exactly that message.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from checkpoint_store.error_log import ErrorLog
from gateway.anchors import Namespace
from gateway.memo import MemoFile, TokenMemo

log = logging.getLogger("gateway.tenants")
SECRET_FILE = "tenant-secret"
SECRET_BYTES = 32
TENANT_DOMAIN = b"ft-tenant-v1\x00"  # what a tenant's salt is derived under (anchors.SALT_DOMAIN folds it)
PUBLIC_FLAG = ":public"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class TenantKey:
    """One line of the key file: `name` ("" for the unnamed key), its key, whether it shares the
    public prefix."""

    name: str
    key: str = field(repr=False)
    public: bool = False


def parse_keys(text: str, source: str) -> str | tuple[TenantKey, ...]:
    """The keys of a key file: one unnamed key (a str), or named tenants. Blank lines are skipped;
    a ValueError names `source` and the line for anything else that is not a key."""
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if len(lines) == 1 and ":" not in lines[0][1]:
        return lines[0][1]
    keys: list[TenantKey] = []
    for n, line in lines:
        name, colon, key = line.partition(":")
        public = key.endswith(PUBLIC_FLAG)
        key = key.removesuffix(PUBLIC_FLAG) if public else key
        if not colon:
            raise ValueError(f"{source}:{n}: several keys must each be named, as NAME:KEY")
        if not NAME.fullmatch(name):
            raise ValueError(f"{source}:{n}: a tenant's name is 1-64 of A-Z a-z 0-9 . _ - (not starting with . _ -)")
        if not key.strip():
            raise ValueError(f"{source}:{n}: the API key of {name!r} is empty")
        keys.append(TenantKey(name, key.strip(), public))
    for what, values in (("name", [k.name for k in keys]), ("key", [k.key for k in keys])):
        if len(set(values)) < len(values):
            raise ValueError(f"{source}: two tenants have the same {what}")
    return tuple(keys)


def server_secret(folder: Path | None) -> bytes:
    """The secret tenants' salts are derived from: kept in `folder` (made there once, 0600), or,
    without a folder it can be kept in, a new one (the checkpoints then live no longer than it)."""
    if folder is None:
        return secrets.token_bytes(SECRET_BYTES)
    path = folder / SECRET_FILE
    try:
        secret = path.read_bytes() if path.exists() else _create(path)
        if len(secret) != SECRET_BYTES:
            log.warning("%s: not a secret of %d bytes; replaced (tenants' checkpoints kept there are not found "
                        "again)", path, SECRET_BYTES)
            secret = _create(path, replace=True)
        return secret
    except OSError as exc:
        log.warning("%s: %s; tenants' checkpoints are kept for this run only", path, exc.strerror or exc)
        return secrets.token_bytes(SECRET_BYTES)


def _create(path: Path, replace: bool = False) -> bytes:
    """A new secret at `path`, written whole before it appears there (a server starting beside this
    one reads it whole or not at all; the first to link it wins and both use that one)."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_bytes(SECRET_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        if replace:
            os.replace(temp, path)
        else:
            try:
                os.link(temp, path)
            except FileExistsError:
                pass
    finally:
        temp.unlink(missing_ok=True)
    return path.read_bytes()


def tenant_salt(secret: bytes, name: str) -> bytes:
    return hmac.new(secret, TENANT_DOMAIN + name.encode(), hashlib.sha256).digest()[:16]


def key_digest(key: bytes) -> bytes:
    """Keys are compared as digests: every comparison takes the same time whatever the lengths."""
    return hashlib.sha256(key).digest()


@dataclass(frozen=True)
class Tenant:
    """What a request of one key works in: its anchors' namespace and its token memo."""

    name: str
    namespace: Namespace
    memo: TokenMemo = field(repr=False)


class Tenants:
    """The keys a server accepts and the tenant of each. Without keys every request is the server's
    own tenant (`default`: its root and memo); so is an unnamed key's."""

    def __init__(self, default: Tenant, keyed: list[tuple[bytes, Tenant]] | None = None):
        self.default = default
        self._keyed = keyed  # (key digest, tenant); None: no key is asked for

    @classmethod
    def build(cls, keys: str | tuple[TenantKey, ...] | None, root: bytes, memo: TokenMemo, folder: Path | None,
              errors: ErrorLog | None = None) -> Tenants:
        """Tenants for `keys` (as `parse_keys` gives them) on the server root anchor `root`; `memo` is
        the server's own; `folder`, a usable disk cache folder, keeps the secret and the tenants' memos."""
        default = Tenant("", Namespace(root), memo)
        if keys is None:
            return cls(default)
        if isinstance(keys, str):
            return cls(default, [(key_digest(keys.encode()), default)])
        secret = server_secret(folder)
        keyed = []
        for k in keys:
            salt = tenant_salt(secret, k.name)
            namespace = Namespace.public(root, salt) if k.public else Namespace.private(root, salt)
            file = MemoFile(folder / f"memo-{namespace.scope.hex()[:16]}", errors=errors) if folder else None
            keyed.append((key_digest(k.key.encode()), Tenant(k.name, namespace, TokenMemo(file=file))))
        return cls(default, keyed)

    @property
    def keyed(self) -> bool:
        return self._keyed is not None

    def find(self, given: bytes) -> Tenant | None:
        """The tenant whose key is `given`: every key compared, in constant time."""
        digest, found = key_digest(given), None
        for key, tenant in self._keyed or ():
            if hmac.compare_digest(digest, key):
                found = tenant
        return found

    def named(self) -> Iterator[Tenant]:
        return (t for _, t in self._keyed or () if t is not self.default)

    def close(self) -> None:
        """Close the named tenants' memos (the server closes its own)."""
        for tenant in self.named():
            tenant.memo.close()
