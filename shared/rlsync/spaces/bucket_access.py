"""Whether a role's token may write the Hub bucket it was given, checked once when the role starts.

A duplicated Space keeps the variables of the Space it was duplicated from. A bucket variable naming the template
owner's bucket would make every write fail with 403 (the trainer blaming the token, the env retrying forever, the
replica showing "running" while following someone else's run). So before a role opens an ``hf://`` bucket, one
``whoami`` call tells the token's user, its organisations and, for a fine-grained token, the namespaces it may write;
a bucket in any other namespace is refused with a :class:`~rlsync.errors.BucketAccessError` that names the variable
to change. When the Hub cannot say (offline, a token it does not know), nothing is refused here: the writes decide.
The call is one of the role's Hub requests: made with its bucket settings' timeouts, it waits for the budget of their
meter and is counted there (the meter the role's bucket then uses, so the panel's totals include it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..bucket.hf_transport import install, metering
from ..bucket.settings import BucketSettings
from ..errors import BucketAccessError
from ..roles import Role
from .settings import SPACE_BUCKET_NAME

logger = logging.getLogger(__name__)

BUCKET_SCHEME = "hf://buckets/"


def bucket_namespace(url: str) -> str | None:
    """The namespace of a ``hf://buckets/NS/NAME[/PREFIX]`` URL, else ``None`` (a local bucket)."""
    if not url.startswith(BUCKET_SCHEME):
        return None
    namespace = url[len(BUCKET_SCHEME) :].split("/", 1)[0]
    return namespace or None


def writable_namespaces(info: Mapping[str, Any]) -> tuple[str, frozenset[str]] | None:
    """``(user, namespaces the token may write)`` from a ``whoami`` answer, or ``None`` when it does not say.

    A ``read`` token may write nowhere; a ``write`` token in its user's and organisations' namespaces; a
    fine-grained one in the namespaces of its scopes that grant a write permission.
    """
    user = info.get("name")
    if not isinstance(user, str) or not user:
        return None
    auth = info.get("auth") if isinstance(info.get("auth"), dict) else {}
    token = auth.get("accessToken") if isinstance(auth.get("accessToken"), dict) else {}
    role = token.get("role")
    if role == "read":
        return user, frozenset()
    if role == "fineGrained":
        scoped = (token.get("fineGrained") or {}).get("scoped") or []
        names = {
            (entry.get("entity") or {}).get("name")
            for entry in scoped
            if isinstance(entry, dict) and any("write" in str(p) for p in entry.get("permissions") or ())
        }
        return user, frozenset(n for n in names if isinstance(n, str))
    orgs = info.get("orgs") if isinstance(info.get("orgs"), list) else []
    return user, frozenset({user} | {o.get("name") for o in orgs if isinstance(o, dict) and isinstance(o.get("name"), str)})


def check_write_access(role: Role, url: str, api: Any | None = None, settings: BucketSettings | None = None) -> None:
    """Refuse a Hub bucket the role's token cannot write (one ``whoami`` call; local buckets pass).

    Args:
        role: The role (its bucket variable, ``<ROLE>_BUCKET``, is named in the message).
        url: The bucket URL the role was given.
        api: An :class:`~huggingface_hub.HfApi` (default: a new one, with the process's token).
        settings: The settings the role opens its bucket with: the call has their timeouts, waits for the budget of
            their meter and is counted there (default: the library's defaults, a meter of its own).

    Raises:
        BucketAccessError: the bucket is in a namespace the token may not write.
    """
    namespace = bucket_namespace(url)
    if namespace is None:
        return
    settings = settings if settings is not None else BucketSettings()
    install(settings.transfer, replace=False)  # the transport that meters (the role's bucket would install it next)
    try:
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi()
        with metering(settings.meter()):
            found = writable_namespaces(api.whoami())
    except Exception as exc:  # noqa: BLE001 - offline, no token, a Hub that cannot say: the writes decide
        logger.info("could not check the token's access to %s before starting: %s", url, type(exc).__name__)
        return
    if found is None or namespace in found[1]:
        return
    user, allowed = found
    variable = f"{role.env_prefix}_BUCKET"
    can = f"can write only to {', '.join(sorted(allowed))}" if allowed else "is read-only"
    raise BucketAccessError(
        f"the {role} cannot write to {url}: the bucket is in the namespace {namespace!r}, and this token (user "
        f"{user!r}) {can}. Set the variable {variable} to a bucket of yours, e.g. "
        f"hf://buckets/{user}/{SPACE_BUCKET_NAME} (on a Space, delete {variable} to use that default), and press "
        "Start again"
    )
