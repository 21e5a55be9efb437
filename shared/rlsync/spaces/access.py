"""Who may use a panel's controls, and where a panel listens.

Panels bind ``127.0.0.1`` unless a host is given (``GRADIO_SERVER_NAME`` or a flag); a Space
listens on ``0.0.0.0``, as its proxy needs. A panel reachable by others (bound elsewhere than
loopback, or running on a Space) lets only an authenticated caller use the controls that change
a run (start, stop, the anchor policy, the environment's settings): a ``PANEL_AUTH``
(``user:password``) login, which applies wherever it is set, or Hugging Face OAuth on a Space
(``hf_oauth: true`` in the Space README) restricted to the Space owner or the members of
``PANEL_OAUTH_ORG``. Without either, its controls refuse every call; the read-only views stay open.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

#: Where a panel listens unless told otherwise.
DEFAULT_HOST = "127.0.0.1"
#: Where a panel listens on a Space (the Space's proxy connects to it).
SPACE_HOST = "0.0.0.0"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
#: The login asked by the panels: ``user:password``.
AUTH_ENV = "PANEL_AUTH"
#: An organisation whose members may use the controls through Hugging Face OAuth (beside the Space owner).
OAUTH_ORG_ENV = "PANEL_OAUTH_ORG"
HOW_TO_LOGIN = (
    f"set {AUTH_ENV}=user:password (a Space secret, or an environment variable), or, on a Space, enable "
    f"Hugging Face OAuth (hf_oauth: true in its README; the Space owner or members of {OAUTH_ORG_ENV} may then log in)"
)


#: Options of every control's event: off the page's API documentation ("Use via API"), still callable, and
#: still refused server-side to whoever :func:`check_control` refuses.
CONTROL_EVENT: dict[str, Any] = {"api_visibility": "undocumented"}


class Login(enum.Enum):
    """How a panel's callers authenticate."""

    NONE = "none"  # loopback only: whoever can reach it is on this machine
    PASSWORD = "password"  # PANEL_AUTH, Gradio's login page
    OAUTH = "oauth"  # Hugging Face OAuth on a Space


def parse_auth(value: str) -> tuple[str, str]:
    """``(user, password)`` from ``user:password``.

    Raises:
        ValueError: not of that form.
    """
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise ValueError(f"{AUTH_ENV} must be 'user:password'")
    return user, password


@dataclasses.dataclass(frozen=True)
class PanelAccess:
    """A panel's bind address and login, from the environment (:meth:`from_env`).

    Attributes:
        host: The address the panel binds.
        auth: The ``PANEL_AUTH`` login, if set.
        space_id: ``SPACE_ID`` when running on a Space.
        owner: The Space's owner (``SPACE_AUTHOR_NAME``), allowed through OAuth.
        oauth_org: ``PANEL_OAUTH_ORG``: an organisation whose members are allowed through OAuth.
        oauth: The Space has Hugging Face OAuth enabled (``OAUTH_CLIENT_ID`` is set).
    """

    host: str = DEFAULT_HOST
    auth: tuple[str, str] | None = dataclasses.field(default=None, repr=False)
    space_id: str = ""
    owner: str = ""
    oauth_org: str = ""
    oauth: bool = False

    @classmethod
    def from_env(cls, host: str | None = None, environ: Mapping[str, str] | None = None) -> PanelAccess:
        """The access of a panel started in ``environ`` (default: the process environment).

        Args:
            host: The host given on the command line (wins over ``GRADIO_SERVER_NAME``).

        Raises:
            ValueError: ``PANEL_AUTH`` is set but not ``user:password``.
        """
        env = os.environ if environ is None else environ
        space_id = env.get("SPACE_ID", "")
        auth = env.get(AUTH_ENV, "")
        return cls(
            host=host or env.get("GRADIO_SERVER_NAME") or (SPACE_HOST if space_id else DEFAULT_HOST),
            auth=parse_auth(auth) if auth else None,
            space_id=space_id,
            owner=env.get("SPACE_AUTHOR_NAME", ""),
            oauth_org=env.get(OAUTH_ORG_ENV, ""),
            oauth=bool(space_id and env.get("OAUTH_CLIENT_ID")),
        )

    @property
    def exposed(self) -> bool:
        """Whether others than this machine's users can reach the panel."""
        return bool(self.space_id) or self.host not in LOOPBACK_HOSTS

    @property
    def login(self) -> Login:
        if self.auth is not None:
            return Login.PASSWORD
        return Login.OAUTH if self.oauth else Login.NONE

    def describe(self) -> str:
        """One line for the launch log."""
        where = f"Space {self.space_id}" if self.space_id else self.host
        if not self.exposed:
            return f"panel on {where}: local only, controls open to this machine"
        if self.login is Login.NONE:
            return f"panel on {where}: reachable by others and no login, so its controls refuse every call; {HOW_TO_LOGIN}"
        return f"panel on {where}: controls need a {self.login.value} login"

    def refusal(self, request: Any) -> str | None:
        """Why the caller of a control is refused, or ``None`` when it may go ahead.

        Args:
            request: The call's ``gr.Request``; its ``username`` is set after a
                ``PANEL_AUTH`` login, its session holds the OAuth login.
        """
        if not self.exposed:
            return None
        user = getattr(request, "username", None) if request is not None else None
        if self.auth is not None and user:  # Gradio checked the login before the call
            return None
        if self.oauth:
            name, orgs = oauth_identity(request)
            if name is not None and (name == self.owner or (self.oauth_org and self.oauth_org in orgs)):
                return None
            if name is not None:
                who = f"the Space owner or {self.oauth_org} members" if self.oauth_org else "the Space owner"
                return f"{name} may not use this panel's controls ({who} only)"
            return "log in with Hugging Face (the button above) to use this panel's controls"
        return f"this panel is reachable by others and has no login, so its controls are off: {HOW_TO_LOGIN}"


    def notice(self, request: Any = None) -> str:
        """The line a panel shows above its controls before any click: whether they are on for this visitor, and
        how to turn them on ("" when there is nothing to say: a local panel, or a password login already passed)."""
        if not self.exposed or self.auth is not None:
            return ""
        if not self.oauth:
            return f":no_entry: **Controls are off**: this panel is reachable by others and has no login. To turn them on, {HOW_TO_LOGIN}."
        reason = self.refusal(request)
        if reason is None:
            name, _ = oauth_identity(request)
            return f"Signed in as **{name}**: the controls are on."
        return f":lock: **Controls are off**: {reason}."


def oauth_identity(request: Any) -> tuple[str | None, frozenset[str]]:
    """The Hugging Face user name and organisations of an OAuth session (``None`` when not logged in)."""
    info = _session(request).get("oauth_info")
    if not isinstance(info, dict) or (info.get("expires_at") or float("inf")) < time.time():
        return None, frozenset()
    userinfo = info.get("userinfo") or {}
    name = userinfo.get("preferred_username") if isinstance(userinfo, dict) else None
    orgs = userinfo.get("orgs") if isinstance(userinfo, dict) else None
    orgs = orgs if isinstance(orgs, list) else []
    names = frozenset(o.get("preferred_username", "") for o in orgs if isinstance(o, dict))
    return (name if isinstance(name, str) and name else None), names


def _session(request: Any) -> Mapping[str, Any]:
    """The session of a call: a ``gr.Request``'s Starlette request's, read from its scope (``gr.Request`` itself
    hands attributes out as copies of another type, and Starlette asserts when no session middleware runs); a
    plain ``session`` mapping otherwise (tests); empty without one."""
    underlying = getattr(request, "request", None) or request
    scope = getattr(underlying, "scope", None)
    if isinstance(scope, dict):
        session = scope.get("session")
    else:
        session = getattr(underlying, "session", None)
    return session if isinstance(session, Mapping) else {}


def launch_access(blocks: Any) -> PanelAccess:
    """The access of a launched ``gr.Blocks``: its actual bind address and login, plus the Space's settings."""
    access = PanelAccess.from_env()
    if blocks is None:
        return access
    auth = ("(gradio)", "(gradio)") if getattr(blocks, "auth", None) else None  # whatever launch(auth=...) was given
    return dataclasses.replace(access, host=getattr(blocks, "server_name", None) or access.host, auth=auth)


def served_access(request: Any) -> PanelAccess:
    """The access of the ``gr.Blocks`` that serves ``request`` (so the bind address it was really launched with
    counts); the environment's for a call not served by Gradio."""
    blocks = None
    try:
        blocks = request.request.app.get_blocks()
    except Exception:  # noqa: BLE001 - not served by Gradio (a direct call in-process): the environment decides
        pass
    return launch_access(blocks)


def control_notice(request: Any) -> str:
    """:meth:`PanelAccess.notice` for the visitor of ``request`` (a page-load event's)."""
    return served_access(request).notice(request)


def check_control(request: Any) -> str | None:
    """Why a control call is refused (logged, counted per reason), or ``None`` (:func:`served_access`)."""
    reason = served_access(request).refusal(request)
    if reason is not None:
        REFUSED[reason] = REFUSED.get(reason, 0) + 1
        if REFUSED[reason] in (1, 10, 100, 1000):
            logger.warning("refused a panel control call (%d so far): %s", REFUSED[reason], reason)
    return reason


#: Refused control calls by reason (this process).
REFUSED: dict[str, int] = {}


def guarded(fn: Callable[..., Any], refused: Callable[[str], Any]) -> Callable[..., Any]:
    """``fn`` as a Gradio event handler that first checks its caller (:func:`check_control`).

    Args:
        fn: The control's action, called with the event's input values.
        refused: Builds the output shown instead, from the reason of a refusal.

    Returns:
        A handler taking the ``gr.Request`` (injected by Gradio) and the input values.
    """
    import gradio as gr

    def handler(request, *values):  # annotated below with the real class: Gradio injects the request by type
        reason = check_control(request)
        return refused(reason) if reason else fn(*values)

    handler.__annotations__ = {"request": gr.Request}
    handler.__name__ = handler.__qualname__ = getattr(fn, "__name__", "control")
    return handler


class LoginGate:
    """ASGI middleware for a panel launched with a ``PANEL_AUTH`` login: an anonymous request to any route
    but the login page and what the page shell loads is refused with 401 before Gradio routes it.

    Gradio checks the login inside each route, after FastAPI has validated the request, and some routes
    (the stream, reset, cancel and vibe-editor endpoints, icons, custom components) check nothing: an
    anonymous call answered 422 with the fields they expect, or held a heartbeat stream open. The gate
    runs first, so every such call gets the same 401 whatever its body.

    Args:
        app: The ASGI app it wraps (Gradio's ``App`` gives itself as ``scope["app"]``, whose login
            tokens and cookie name the gate reads).
    """

    #: Paths anyone may fetch: the page (the login form without a login), the login itself, and answers
    #: that hold nothing (no user, no token, the app's id, the theme, icons).
    PUBLIC_PATHS = frozenset({
        "/", "/login", "/login/", "/logout", "/favicon.ico", "/theme.css", "/robots.txt", "/manifest.json",
        "/gradio_api/theme.css", "/gradio_api/user", "/gradio_api/user/", "/gradio_api/token", "/gradio_api/token/",
        "/gradio_api/app_id", "/gradio_api/app_id/", "/gradio_api/startup-events", "/openapi.json",
    })  # fmt: skip
    #: Folders of the page's static files (scripts, styles, fonts), fetched before the login.
    PUBLIC_FOLDERS = ("/assets/", "/static/", "/svelte/")

    def __init__(self, app: Any) -> None:
        self.app = app

    @classmethod
    def public(cls, path: str) -> bool:
        """Whether `path` is served without a login."""
        return path in cls.PUBLIC_PATHS or path.startswith(cls.PUBLIC_FOLDERS)

    @staticmethod
    def logged_in(scope: dict) -> bool:
        """Whether the request in `scope` carries the session cookie of a login of the Gradio app it reaches
        (or that app has no ``auth`` login to check)."""
        from starlette.requests import HTTPConnection

        served = scope.get("app")
        if getattr(served, "auth", None) is None:
            return True
        cookies = HTTPConnection(scope).cookies
        cookie_id = getattr(served, "cookie_id", "")
        token = cookies.get(f"access-token-{cookie_id}") or cookies.get(f"access-token-unsecure-{cookie_id}")
        return token is not None and token in getattr(served, "tokens", {})

    async def __call__(self, scope: dict, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if self.public(path) or self.logged_in(scope):
            return await self.app(scope, receive, send)
        REFUSED["anonymous request with a login set"] = REFUSED.get("anonymous request with a login set", 0) + 1
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        from starlette.responses import JSONResponse

        await JSONResponse({"detail": {"error": "Not authenticated"}}, status_code=401)(scope, receive, send)
