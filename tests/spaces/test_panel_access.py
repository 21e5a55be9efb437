"""Panels are safe by default (issue 18 item 7, issue 26 critical 8 and low 1).

Real Gradio servers (the combined ``app.py`` panel, holding the three Spaces' panels) called over
HTTP by ``gradio_client`` and plain ``httpx``: bound to loopback the controls work without a login;
reachable by others without a login every control refuses; with ``PANEL_AUTH`` (set anywhere, not
only on a Space) an anonymous call is refused by the login and an authenticated one works.
"""

from __future__ import annotations

import json
import os
import re
import socket

import httpx
import markdown_it
import pytest

import app  # the combined panel (the repository root is on the path, as for every test)
from rlsync.bucket import LocalBucket
from rlsync.layout import CONTROL_KEY
from rlsync.spaces import access, frames, role_control
from rlsync.spaces.page import launch_options
from rlsync.spaces.metrics import MetricsLog, TrainerMetrics, TrainRow
from rlsync.spaces.snapshots import Snapshot

gradio_client = pytest.importorskip("gradio_client")

LOGIN = ("admin", "pw-8Qz1-panel")
#: Every control of the combined panel, by API name.
CONTROLS = ("start_all", "stop_all", "trainer_start_trainer", "trainer_stop_trainer", "rollout_start_rollout",
            "rollout_stop_rollout", "env_start_env", "env_stop_env", "trainer_apply_anchor_policy")  # fmt: skip


class FakeRole:
    """Stands in for a Trainer/Replica/EnvSimulator: the test is about who may start it."""

    def __init__(self, started: list[str], name: str) -> None:
        self.started, self.name, self._running = started, name, False

    def start(self) -> None:
        self.started.append(self.name)
        self._running = True

    def stop(self) -> None:
        self._running = False

    @property
    def running(self) -> bool:
        return self._running


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def clean_env(monkeypatch):
    for key in ("SPACE_ID", "PANEL_AUTH", "GRADIO_SERVER_NAME", "OAUTH_CLIENT_ID", "SPACE_AUTHOR_NAME", "PANEL_OAUTH_ORG"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.fixture
def panel(tmp_path, clean_env):
    """Launch the combined panel with ``launch_options(host)``; yields ``(url, started roles, bucket)``."""
    launched = []

    def launch(host: str | None = None):
        started: list[str] = []
        stack = app.Stack(str(tmp_path / "bucket"), replicas=1)
        for name in ("trainer", "env", "rollout"):
            setattr(stack, name, role_control.RoleRunner(name, lambda cfg, n=name: [FakeRole(started, n)]))
        demo = app.build_app(stack)
        port = free_port()
        options = {**launch_options(host), "server_port": port}
        demo.launch(prevent_thread_lock=True, quiet=True, **options)
        launched.append(demo)
        return demo, f"http://127.0.0.1:{port}/", started, stack

    yield launch
    for demo in launched:
        demo.close()


def call(client, name: str, demo=None):
    """Call a control by API name. The controls are off the API page (``api_visibility="undocumented"``), so the
    client knows no defaults for their inputs: the form's values are sent, read from ``demo``."""
    if name == "trainer_apply_anchor_policy":
        return client.predict("fixed", 3, 2.0, api_name=f"/{name}")
    values = [] if demo is None else control_inputs(demo, name)
    return client.predict(*values, api_name=f"/{name}")


def control_inputs(demo, name: str) -> list:
    """The initial values of the inputs of the event ``name`` of ``demo``."""
    [fn] = [fn for fn in demo.fns.values() if fn.api_name == name]
    return [component.value for component in fn.inputs]


def test_controls_are_off_the_api_page_and_still_refused(panel):
    demo, url, started, stack = panel("0.0.0.0")
    client = gradio_client.Client(url, verbose=False)
    info = httpx.get(f"{url}gradio_api/info", timeout=10).json()
    documented = set(info["named_endpoints"]) | set(info.get("unnamed_endpoints", {}))
    assert not {f"/{name}" for name in CONTROLS} & documented, documented
    assert "/trainer_start_trainer" in {f"/{fn.api_name}" for fn in demo.fns.values()}  # still an endpoint
    assert "PANEL_AUTH" in str(call(client, "trainer_start_trainer", demo)) and started == []


def test_default_bind_is_loopback_and_a_space_listens_everywhere(clean_env):
    assert launch_options()["server_name"] == "127.0.0.1"
    assert "auth" not in launch_options()
    clean_env.setenv("GRADIO_SERVER_NAME", "0.0.0.0")
    assert launch_options()["server_name"] == "0.0.0.0"
    assert launch_options("127.0.0.1")["server_name"] == "127.0.0.1"  # app.py --host wins
    clean_env.delenv("GRADIO_SERVER_NAME")
    clean_env.setenv("SPACE_ID", "me/rl-sync-trainer")
    assert launch_options()["server_name"] == "0.0.0.0"
    assert access.PanelAccess.from_env().exposed


def test_app_takes_a_host_flag():
    assert app.parse_args([]).host is None and app.parse_args(["--host", "0.0.0.0"]).host == "0.0.0.0"


def test_loopback_panel_controls_work_without_login(panel):
    demo, url, started, stack = panel()
    assert demo.server_name == "127.0.0.1"
    client = gradio_client.Client(url, verbose=False)
    assert "running" in call(client, "trainer_start_trainer", demo)
    assert started == ["trainer"]


def test_exposed_panel_without_login_refuses_every_control(panel, tmp_path):
    demo, url, started, stack = panel("0.0.0.0")
    client = gradio_client.Client(url, verbose=False)
    for name in CONTROLS:
        assert "PANEL_AUTH" in str(call(client, name, demo)), name
    assert started == [] and not any(r.objects for r in stack.runners)
    assert not LocalBucket(tmp_path / "bucket").exists(CONTROL_KEY)  # the anchor policy was not written
    assert sum(access.REFUSED.values()) >= len(CONTROLS)


@pytest.mark.parametrize("host", ["0.0.0.0", None])
def test_panel_auth_applies_wherever_it_is_set(panel, clean_env, tmp_path, host):
    """PANEL_AUTH without SPACE_ID (ignored before): anonymous HTTP calls are refused, logged-in ones work."""
    clean_env.setenv("PANEL_AUTH", ":".join(LOGIN))
    demo, url, started, stack = panel(host)
    for name in CONTROLS:
        posted = httpx.post(f"{url}gradio_api/call/{name}", json={"data": []}, timeout=10)
        assert posted.status_code == 401, (name, posted.status_code, posted.text[:200])
    with pytest.raises(Exception):
        gradio_client.Client(url, verbose=False)  # no login, no config
    client = gradio_client.Client(url, auth=LOGIN, verbose=False)
    assert "Applied" in call(client, "trainer_apply_anchor_policy")
    assert json.loads(LocalBucket(tmp_path / "bucket").get(CONTROL_KEY))["interval"] == 3
    assert "running" in call(client, "env_start_env", demo)
    assert started == ["env"]
    call(client, "env_stop_env", demo)


def test_space_panel_without_login_refuses_and_says_how(clean_env):
    clean_env.setenv("SPACE_ID", "me/rl-sync-env")
    space = access.PanelAccess.from_env()
    assert space.refusal(None) and "PANEL_AUTH=user:password" in space.refusal(None)
    assert "refuse every call" in space.describe()


def test_oauth_is_restricted_to_the_owner_or_the_named_org(clean_env):
    clean_env.setenv("SPACE_ID", "me/rl-sync-trainer")
    clean_env.setenv("SPACE_AUTHOR_NAME", "me")
    clean_env.setenv("OAUTH_CLIENT_ID", "x")
    clean_env.setenv("PANEL_OAUTH_ORG", "team")

    class Request:
        def __init__(self, user: str | None, orgs=()):
            info = {"userinfo": {"preferred_username": user, "orgs": [{"preferred_username": o} for o in orgs]}}
            self.session = {"oauth_info": info} if user else {}
            self.username = None

    oauth = access.PanelAccess.from_env()
    assert oauth.login is access.Login.OAUTH
    assert oauth.refusal(Request("me")) is None and oauth.refusal(Request("ann", ["team"])) is None
    assert "may not use" in oauth.refusal(Request("ann", ["other"]))
    assert "log in" in oauth.refusal(Request(None))


def test_trainer_notice_and_other_bucket_strings_render_as_text():
    planted = "![beacon](http://beacon.example/p.gif) [click](http://evil.example) <img src=http://beacon.example/q.gif> www.evil.example"
    snap = Snapshot(trainer=TrainerMetrics.from_json({
        "rows": [{"kind": "train"}], "notice": planted, "opt_steps": "<img src=x>",
        "refused": {"total": 1, "by_kind": {"scores": 1}, "last": "`![b](http://b.example/x)"},
    }))  # fmt: skip
    line = frames.trainer_summary(snap)
    for md in (markdown_it.MarkdownIt(), markdown_it.MarkdownIt("gfm-like")):
        html = md.render(line)
        assert "<img" not in html and "<a " not in html and "<code" not in html, html
        assert "beacon.example/p.gif" in html  # shown, as text


@pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"), reason="/usr/bin/chromium is missing")
def test_planted_notice_shows_as_text_in_the_browser(tmp_path, clean_env):
    """The trainer Space's panel in headless Chromium: a planted image beacon and link in the notice of
    ``metrics/trainer.json`` appear as text; no <img> or <a> is rendered in the summary line."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from trainer_space import app as trainer_app
    from trainer_space.trainer import TrainerConfig

    bucket = LocalBucket(tmp_path / "bucket")
    log = MetricsLog(bucket, TrainerMetrics)
    log.add(TrainRow(kind="train", opt_step=1, version=0, loss=0.5))
    beacon = "PLANTED ![b](http://127.0.0.1:9/b.gif) [x](http://127.0.0.1:9/x) <img src=http://127.0.0.1:9/c.gif>"
    log.state = TrainerMetrics(version=0, opt_steps=1, notice=beacon)
    log.flush()
    demo = trainer_app.build_app(TrainerConfig(bucket=str(tmp_path / "bucket")), runner=trainer_app.make_runner())
    port = free_port()
    demo.launch(prevent_thread_lock=True, quiet=True, **{**launch_options(), "server_port": port})
    try:
        with sync_api.sync_playwright() as pw:
            args = ["--headless", "--no-sandbox", "--disable-gpu"]
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=args)
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}/")
            summary = page.locator("#trainer-summary")
            summary.get_by_text("PLANTED").wait_for(timeout=60_000)
            assert "![b](http://127.0.0.1:9/b.gif)" in summary.inner_text() and "<img src=" in summary.inner_text()
            assert summary.locator("img").count() == 0 and summary.locator("a").count() == 0
            browser.close()
    finally:
        demo.close()


#: Routes Gradio serves to anyone, login or not: the login page and the page shell, static assets,
#: and answers that hold nothing (no user, no token, the app's id). Everything else needs the login.
PUBLIC_ROUTES = frozenset({
    "/", "/openapi.json", "/logout", "/favicon.ico", "/theme.css", "/robots.txt", "/manifest.json",
    "/gradio_api/theme.css", "/gradio_api/user", "/gradio_api/user/", "/gradio_api/token", "/gradio_api/token/",
    "/gradio_api/app_id", "/gradio_api/app_id/", "/gradio_api/startup-events",
})  # fmt: skip


def _routes(routes, base: str = ""):
    for route in routes:
        path = base + getattr(route, "path", "")
        if hasattr(route, "routes") and not hasattr(route, "methods"):
            yield from _routes(route.routes, path)
        else:
            yield path, set(getattr(route, "methods", None) or {"GET"}) - {"HEAD", "OPTIONS"}


def test_with_a_login_every_route_gradio_mounts_refuses_anonymous_callers(panel, clean_env, monkeypatch):
    clean_env.setenv("PANEL_AUTH", LOGIN[0] + ":" + LOGIN[1])
    monkeypatch.setenv("HF_TOKEN", "hf_operatorTOKENthatMustNotBeUsed")
    demo, url, _, _ = panel()
    mounted = list(_routes(demo.server_app.routes))
    assert any(path == "/gradio_api/queue/join" for path, _ in mounted)  # the walk reaches Gradio's API routes
    assert not [path for path, _ in mounted if "run-history" in path]  # /gradio_api/runs stays, answering 404
    for path in ("gradio_api/run-history/buckets", "gradio_api/run-history/records?bucket=me/b", "gradio_api/runs"):
        assert httpx.get(url + path, timeout=10).status_code in (401, 404)
    connect = httpx.post(url + "gradio_api/run-history/connect", json={"bucket_id": "me/b"}, timeout=10)
    assert connect.status_code in (401, 404)
    answered = {}
    for path, methods in mounted:
        if path in PUBLIC_ROUTES or path.startswith(("/login", "/static", "/assets", "/svelte")):
            continue
        for method in methods:  # path parameters filled in; refused by the login, not by body validation (422)
            status = httpx.request(method, url.rstrip("/") + re.sub(r"\{[^}]*\}", "1", path),
                                   json={} if method == "POST" else None, timeout=10).status_code  # fmt: skip
            if status not in (401, 403):
                answered[f"{method} {path}"] = status
    assert answered == {}
    with httpx.Client(base_url=url, timeout=10) as client:  # the gate lets a logged-in caller through
        assert client.get("config").status_code == 401
        assert client.post("login", data={"username": LOGIN[0], "password": LOGIN[1]}).status_code == 200
        assert client.get("config").status_code == 200 and client.get("gradio_api/info").status_code == 200
