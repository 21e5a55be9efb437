"""Users, organisations and what their tokens may write, for the Hub stand-in (:mod:`testing.hub.server`).

A token added with :meth:`HubServer.add_token <testing.hub.server.HubServer.add_token>` alone belongs to nobody
and writes every bucket its role allows (the stand-in's first tests need no namespaces). A token of a user
(:meth:`Accounts.add_user`) writes, as on the Hub, only in its user's and organisations' namespaces; it reads any
bucket (buckets here are public). ``GET /api/whoami-v2`` answers for user tokens as the Hub does (name, orgs, the
token's role), and 401 for the others.
"""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class Account:
    """A Hub user: its name and the organisations it belongs to."""

    name: str
    orgs: tuple[str, ...] = ()

    @property
    def namespaces(self) -> frozenset[str]:
        return frozenset((self.name, *self.orgs))


class Accounts:
    """The stand-in's users and their tokens (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.users: dict[str, Account] = {}
        self._owners: dict[str, tuple[str, str]] = {}  # token -> (user, role)

    def add_user(self, name: str, token: str | None = None, orgs: tuple[str, ...] = (), role: str = "write") -> None:
        """Add (or replace) user ``name``, in ``orgs``, with ``token`` of ``role`` ("read" or "write")."""
        with self._lock:
            self.users[name] = Account(name, tuple(orgs))
            if token is not None:
                self._owners[token] = (name, role)

    def owner(self, token: str | None) -> Account | None:
        """The user of ``token``, or ``None`` (no token, or one of nobody)."""
        with self._lock:
            owned = self._owners.get(token or "")
            return self.users.get(owned[0]) if owned else None

    def may_write(self, token: str | None, namespace: str) -> bool:
        """Whether ``token`` may write in ``namespace`` (a token of nobody: as its role says, checked elsewhere)."""
        account = self.owner(token)
        return account is None or namespace in account.namespaces

    def whoami(self, token: str | None) -> dict | None:
        """The ``/api/whoami-v2`` answer for ``token``, or ``None`` (401)."""
        account = self.owner(token)
        if account is None:
            return None
        with self._lock:
            role = self._owners[token or ""][1]
        return {
            "type": "user",
            "name": account.name,
            "fullname": account.name.title(),
            "avatarUrl": f"/avatars/{account.name}.png",
            "orgs": [{"type": "org", "name": org, "fullname": org.title(), "roleInOrg": "write"} for org in account.orgs],
            "auth": {"type": "access_token", "accessToken": {"displayName": "stand-in", "role": role}},
        }
