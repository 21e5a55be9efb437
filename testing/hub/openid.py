"""The Hub stand-in's OpenID Connect provider: "Sign in with Hugging Face" for Spaces run by
:mod:`testing.spaces_runtime`.

It answers what Gradio's OAuth (authlib's Starlette client, ``gradio.oauth``) asks of the Hub's provider, whose
address a Space with ``hf_oauth: true`` gets as ``OPENID_PROVIDER_URL``:

- ``GET /.well-known/openid-configuration``: the provider's metadata;
- ``GET /oauth/authorize``: the sign-in page (the Hub shows its consent page to a signed-in user; here a form asks
  which user of :class:`~testing.hub.accounts.Accounts` signs in), whose ``POST`` sends the browser back to the
  Space's ``redirect_uri`` with a one-time code;
- ``POST /oauth/token``: the code and the client's credentials (HTTP Basic or form fields) for an access token and
  an RS256-signed ID token (``preferred_username``, ``name``, ``orgs``: what the panel checks);
- ``GET /oauth/userinfo`` and ``GET /oauth/jwks``.

A client (one per Space, as the Hub makes one OAuth app per ``hf_oauth`` Space) is registered with its secret and
the one redirect URI the Hub allows it, ``https://<SPACE_HOST>/login/callback`` (its query, Gradio's ``_target_url``,
may vary).
"""

from __future__ import annotations

import base64
import dataclasses
import html
import secrets
import threading
import time
from urllib.parse import parse_qs, urlencode

#: Paths the provider serves.
PATHS = ("/.well-known/openid-configuration", "/oauth/authorize", "/oauth/token", "/oauth/userinfo", "/oauth/jwks")
#: Seconds a sign-in lasts (the Hub's default for Spaces: 8 hours).
TOKEN_TTL_S = 8 * 3600


@dataclasses.dataclass(frozen=True)
class Client:
    """One OAuth app: its secret and the redirect URI it may use."""

    secret: str
    redirect_uri: str


@dataclasses.dataclass(frozen=True)
class Grant:
    """A code handed to the browser, for one client, user, redirect URI and nonce."""

    client_id: str
    user: str
    redirect_uri: str
    nonce: str
    scope: str


class OpenIdProvider:
    """Clients, codes and tokens of the provider; its signing key is made once per stand-in."""

    def __init__(self) -> None:
        from joserfc.jwk import RSAKey

        self.key = RSAKey.generate_key(2048, parameters={"kid": "stand-in", "use": "sig", "alg": "RS256"})
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.clients: dict[str, Client] = {}
            self.codes: dict[str, Grant] = {}
            self.tokens: dict[str, dict] = {}
            #: Sign-ins completed (user names), in order.
            self.signed_in: list[str] = []

    def add_client(self, client_id: str, secret: str, redirect_uri: str) -> None:
        with self._lock:
            self.clients[client_id] = Client(secret, redirect_uri)

    def claims(self, issuer: str, user: str, orgs: tuple[str, ...], scope: str) -> dict:
        """The ID token's user claims (``profile`` ones only with that scope)."""
        claims = {"sub": f"user-{user}"}
        if "profile" in scope.split():
            claims.update(name=user.title(), preferred_username=user, profile=f"{issuer}/{user}",
                          picture=f"{issuer}/avatars/{user}.png",
                          orgs=[{"sub": f"org-{o}", "name": o.title(), "preferred_username": o, "picture": "",
                                 "isEnterprise": False} for o in orgs])  # fmt: skip
        return claims


def serve(handler, path: str, query: dict, body: bytes) -> None:
    """Answer one provider request on ``handler`` (a :class:`testing.hub.handler.Handler`)."""
    hub, provider = handler.hub, handler.hub.openid
    if path == "/.well-known/openid-configuration":
        return handler._send(200, metadata(hub.url))
    if path == "/oauth/jwks":
        return handler._send(200, {"keys": [provider.key.as_dict(private=False)]})
    if path == "/oauth/authorize" and handler.command == "GET":
        return _page(handler, 200, _form({k: v[0] for k, v in query.items()}))
    if path == "/oauth/authorize" and handler.command == "POST":
        return _authorize(handler, {k: v[0] for k, v in parse_qs(body.decode()).items()})
    if path == "/oauth/token" and handler.command == "POST":
        return _token(handler, {k: v[0] for k, v in parse_qs(body.decode()).items()})
    if path == "/oauth/userinfo":
        auth = handler.headers.get("Authorization") or ""
        claims = provider.tokens.get(auth.removeprefix("Bearer "))
        return handler._send(200, claims) if claims else handler._error(401, "invalid access token")
    handler._error(404, "not found")


def metadata(issuer: str) -> dict:
    """The provider's ``/.well-known/openid-configuration``."""
    return {
        "issuer": issuer,
        "authorization_endpoint": f"{issuer}/oauth/authorize",
        "token_endpoint": f"{issuer}/oauth/token",
        "userinfo_endpoint": f"{issuer}/oauth/userinfo",
        "jwks_uri": f"{issuer}/oauth/jwks",
        "response_types_supported": ["code"],
        "subject_types_supported": ["public"],
        "id_token_signing_alg_values_supported": ["RS256"],
        "scopes_supported": ["openid", "profile", "email", "read-repos", "write-repos", "manage-repos"],
        "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post"],
    }


def _page(handler, status: int, text: str) -> None:
    handler._send(status, text.encode(), {"Content-Type": "text/html; charset=utf-8"})


def _form(params: dict[str, str]) -> str:
    hidden = "".join(f'<input type="hidden" name="{html.escape(k)}" value="{html.escape(v)}">' for k, v in params.items())
    return (
        "<!doctype html><title>Sign in with Hugging Face (stand-in)</title><h1>Sign in with Hugging Face</h1>"
        f'<form method="post" action="/oauth/authorize">{hidden}'
        '<label>Username <input id="username" name="username" autocomplete="off"></label> '
        '<button id="authorize" type="submit">Authorize</button></form>'
    )


def _authorize(handler, form: dict[str, str]) -> None:
    provider = handler.hub.openid
    client = provider.clients.get(form.get("client_id", ""))
    redirect_uri = form.get("redirect_uri", "")
    if client is None or redirect_uri.split("?")[0] != client.redirect_uri or form.get("response_type") != "code":
        return _page(handler, 400, "unknown OAuth app or redirect URI")
    user = form.get("username", "")
    if handler.hub.accounts.users.get(user) is None:
        return _page(handler, 403, f"no such user: {html.escape(user)}")
    code = secrets.token_urlsafe(16)
    with provider._lock:
        provider.codes[code] = Grant(form["client_id"], user, redirect_uri, form.get("nonce", ""),
                                     form.get("scope", "openid"))  # fmt: skip
    query = urlencode({"code": code, "state": form.get("state", "")})
    handler._send(302, b"", {"Location": f"{redirect_uri}{'&' if '?' in redirect_uri else '?'}{query}"})


def _client_credentials(handler, form: dict[str, str]) -> tuple[str, str]:
    auth = handler.headers.get("Authorization") or ""
    if auth.startswith("Basic "):
        client_id, _, secret = base64.b64decode(auth[6:]).decode().partition(":")
        return client_id, secret
    return form.get("client_id", ""), form.get("client_secret", "")


def _token(handler, form: dict[str, str]) -> None:
    from joserfc import jwt

    hub, provider = handler.hub, handler.hub.openid
    client_id, secret = _client_credentials(handler, form)
    client = provider.clients.get(client_id)
    if client is None or not secrets.compare_digest(client.secret, secret):
        return handler._error(401, "invalid client")
    with provider._lock:
        grant = provider.codes.pop(form.get("code", ""), None)
    if grant is None or grant.client_id != client_id or form.get("redirect_uri") != grant.redirect_uri:
        return handler._error(400, "invalid_grant")
    now = int(time.time())
    claims = provider.claims(hub.url, grant.user, hub.accounts.users[grant.user].orgs, grant.scope)
    id_claims = {**claims, "iss": hub.url, "aud": client_id, "iat": now, "exp": now + TOKEN_TTL_S, "auth_time": now,
                 **({"nonce": grant.nonce} if grant.nonce else {})}  # fmt: skip
    id_token = jwt.encode({"alg": "RS256", "kid": "stand-in"}, id_claims, provider.key)
    access_token = f"hf_oauth_{secrets.token_urlsafe(16)}"
    with provider._lock:
        provider.tokens[access_token] = claims
        provider.signed_in.append(grant.user)
    handler._send(200, {"access_token": access_token, "token_type": "bearer", "expires_in": TOKEN_TTL_S,
                        "id_token": id_token, "scope": grant.scope})  # fmt: skip

