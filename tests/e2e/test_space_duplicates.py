"""Duplicate this Space, as a new owner does it: the template exported (``python -m rlsync.spaces.deploy --export``),
each Space run as a duplicate by the Spaces runtime stand-in (:mod:`testing.spaces_runtime`: its own process, the
runtime's variables, the OAuth app of ``hf_oauth: true``, the inherited variables, only the ``HF_TOKEN`` secret),
against the Hub stand-in in a process of its own (:class:`testing.hub.process.HubProcess`), signed in with the
stand-in's OpenID provider from headless Chromium, Start pressed on each page.

1. alice's three duplicates, with only ``HF_TOKEN``: the first version lands in ``hf://buckets/alice/rl-sync``
   (created at Start, not at a page view) and her replica follows it.
2. Two rollout duplicates of alice's get distinct replica ids, and both show in the trainer page's fleet table.
4. bob's env duplicate that inherited the old template's ``ENV_BUCKET`` (rlsync's bucket) fails at Start with a
   message naming the variable, and stays failed: no "running", no retries against rlsync's bucket.
5. bob signing in to alice's Space is refused: the page says so before any click, and the refusal of his Start
   stays on the page across refreshes. A member of the organisation named in ``PANEL_OAUTH_ORG`` is let in.

Needs the ``playwright`` package and Chromium (:mod:`testing.panel_browser`); skipped otherwise. Slow (processes,
a browser, training): ``tests/conftest.py`` marks it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed (pip install playwright)")
pytest.importorskip("itsdangerous", reason="gradio[oauth] is not installed (pip install -r requirements-dev.txt)")

from testing.hub.process import HubProcess  # noqa: E402
from testing.panel_browser import CHROMIUM, open_browser  # noqa: E402
from testing.served import poll_until  # noqa: E402
from testing.spaces_runtime import SpaceProcess, template_variables  # noqa: E402

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)", allow_module_level=True)

TOKENS = {"alice": "hf_alice_write_token", "bob": "hf_bob_write_token", "rlsync": "hf_rlsync_write_token",
          "carol": "hf_carol_write_token"}
#: Organisations of the users (carol is in team).
ORGS = {"carol": ("team",)}
#: What the template's duplicates inherited before issue 39: its owner's bucket.
TEMPLATE_BUCKET = "hf://buckets/rlsync/rl-sync"
#: Seconds for the first version to land and the replica to apply it (three Spaces and a browser on 2 shared cores).
FIRST_VERSION_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    from rlsync.spaces import deploy

    folder = tmp_path_factory.mktemp("template")
    assert deploy.main(["--export", str(folder)], out=open(os.devnull, "w")) == 0  # noqa: SIM115
    return folder


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Iterator[HubProcess]:
    from huggingface_hub import HfApi

    process = HubProcess(tmp_path_factory.mktemp("hub"))
    try:
        for user, token in TOKENS.items():
            process.add_user(user, token, ORGS.get(user, ()))
        with pytest.MonkeyPatch.context() as mp:
            _point_at(mp, process.url)
            HfApi(endpoint=process.url, token=TOKENS["rlsync"]).create_bucket("rlsync/rl-sync")  # the template's
        yield process
    finally:
        process.close()


def _point_at(mp: pytest.MonkeyPatch, url: str) -> None:
    """huggingface_hub in this process, online and pointed at the stand-in."""
    from huggingface_hub import constants

    mp.setenv("HF_ENDPOINT", url)
    mp.setattr(constants, "ENDPOINT", url)
    mp.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with open_browser() as context:
        yield context


class Spaces:
    """The duplicates a test runs: started, closed at the end with their logs printed."""

    def __init__(self, export: Path, hub: HubProcess, logs: Path) -> None:
        self.export, self.hub, self.logs, self.running = export, hub, logs, []

    def duplicate(self, template: str, space_id: str, token: str, variables: dict[str, str] | None = None) -> SpaceProcess:
        """``space_id`` duplicated from the template Space ``template``: its variables, plus ``variables``."""
        inherited = {**template_variables(self.export, template), **(variables or {})}
        space = SpaceProcess(self.export / template, space_id, self.hub, secrets={"HF_TOKEN": token},
                             variables=inherited, log=self.logs / f"{space_id.replace('/', '--')}.log")  # fmt: skip
        self.running.append(space)
        return space

    def running_or_duplicate(self, template: str, space_id: str, token: str) -> SpaceProcess:
        """The duplicate ``space_id`` an earlier test of the module started, else a new one (:meth:`duplicate`)."""
        found = [space for space in self.running if space.space_id == space_id]
        return found[0] if found else self.duplicate(template, space_id, token)

    def close(self) -> None:
        for space in self.running:
            space.close()
            print(f"--- {space.space_id} log tail ---\n{space.log_tail(2500)}")


@pytest.fixture(scope="module")
def spaces(export, hub, tmp_path_factory) -> Iterator[Spaces]:
    running = Spaces(export, hub, tmp_path_factory.mktemp("logs"))
    try:
        yield running
    finally:
        running.close()


def wait_for(what: str, check: Callable[[], object], timeout: float, spaces: list[SpaceProcess], every: float = 1.0,
             page=None):  # fmt: skip
    """:func:`~testing.served.poll_until`, failing with the tails of the Spaces' logs (and the status lines of
    ``page``: what the panel showed instead)."""

    def describe() -> str:
        shown = "" if page is None else "\n".join(f"#{e.get_attribute('id')}: {e.inner_text()}" for e in
                                                   page.locator("[id^=status-], [id^=result-]").all())
        return shown + "\n" + "\n".join(f"--- {s.space_id} ---\n{s.log_tail(6000)}" for s in spaces)

    return poll_until(what, check, timeout, describe, every)


def sign_in(browser, space: SpaceProcess, user: str):
    """A page of ``space`` signed in as ``user`` through the stand-in's provider (the runtime's HTTPS proxy is a
    route: ``https://<SPACE_HOST>/...`` goes to the Space's local address), once the page names the user."""
    browser.route(f"https://{space.host}/**", lambda route: route.fulfill(
        status=302, headers={"Location": space.local(route.request.url)}))  # fmt: skip
    page = browser.new_page()
    page.goto(space.url)
    page.get_by_role("button", name="Sign in with Hugging Face").click()
    page.wait_for_url("**/oauth/authorize**", timeout=60_000)
    page.fill("#username", user)
    page.click("#authorize")
    page.wait_for_url(f"{space.url}**", timeout=60_000)
    # the page names who signed in: "Signed in as <user>", or "<user> may not use this panel's controls"
    page.locator("#controls-notice").get_by_text(user).wait_for(timeout=60_000)
    return page


def start(page, role: str) -> None:
    page.get_by_role("button", name=f"Start {role}").click()


def text(page, elem_id: str) -> str:
    return page.locator(f"#{elem_id}").inner_text()


def open_hub_bucket(hub: HubProcess, bucket_id: str, token: str):
    """``bucket_id`` on the stand-in, read with ``token`` from this process."""
    from huggingface_hub import HfApi

    from rlsync.bucket.budget import BudgetConfig, RequestMeter
    from rlsync.bucket.hf import HfBucket

    return HfBucket(bucket_id, token=token, api=HfApi(endpoint=hub.url, token=token),
                    meter=RequestMeter(BudgetConfig(enabled=False)))  # fmt: skip


def retried(read: Callable[[], object]) -> object:
    """``read()``, or ``None`` on a bucket error (a read made while the Spaces start: the caller polls again)."""
    from rlsync.errors import BucketError

    try:
        return read()
    except BucketError:
        return None


def test_another_users_sign_in_is_refused(spaces, hub, browser) -> None:
    """5. bob signs in to alice's trainer: the page says the controls are off for him before any click, his Start is
    refused server-side, and the refusal stays shown across refreshes (the 1.5 s refresh overwrote it before)."""
    trainer = spaces.duplicate("rl-sync-trainer", "alice/rl-sync-trainer", TOKENS["alice"])
    trainer.wait_ready()
    page = browser.new_page()
    page.goto(trainer.url)
    page.get_by_text("Controls are off").first.wait_for(timeout=60_000)  # before any click, anonymous
    assert "log in with Hugging Face" in text(page, "controls-notice")
    assert "alice/rl-sync" not in hub.buckets()  # a page view created nothing
    page = sign_in(browser, trainer, "bob")
    page.get_by_text("bob may not use this panel's controls").first.wait_for(timeout=60_000)
    start(page, "trainer")
    page.get_by_text("not started: bob may not use").first.wait_for(timeout=30_000)
    time.sleep(4)  # more than two refreshes
    assert "not started: bob may not use this panel's controls" in text(page, "result-trainer")
    assert "stopped" in text(page, "status-trainer") and "alice/rl-sync" not in hub.buckets()
    assert hub.signed_in() == ["bob"]


def test_inherited_template_bucket_fails_naming_the_variable(spaces, hub, browser) -> None:
    """4. bob's env duplicate kept the old template's ENV_BUCKET (rlsync's): Start fails with the variable's name,
    and the role stays failed (no "running", nothing written to rlsync's bucket, no retry)."""
    env = spaces.duplicate("rl-sync-env", "bob/rl-sync-env", TOKENS["bob"], {"ENV_BUCKET": TEMPLATE_BUCKET})
    env.wait_ready()
    page = sign_in(browser, env, "bob")
    before = hub.buckets()["rlsync/rl-sync"]
    start(page, "env")
    status = wait_for("the env's failure", lambda: "failed" in text(page, "status-env") and text(page, "status-env"),
                      120, [env])  # fmt: skip
    assert "ENV_BUCKET" in status and "rlsync" in status and "hf://buckets/bob/rl-sync" in status, status
    time.sleep(5)
    assert "failed" in text(page, "status-env") and "running" not in text(page, "status-env")
    assert hub.buckets()["rlsync/rl-sync"] == before and "bob/rl-sync" not in hub.buckets()


def test_three_duplicates_with_only_a_token_train_in_the_owners_bucket(spaces, hub, browser) -> None:
    """1 and 2. alice duplicates the trainer, the env and two rollout Spaces, sets only HF_TOKEN, signs in and
    presses Start on each: the first version lands in hf://buckets/alice/rl-sync and both replicas (two ids from the
    two Space ids) follow it and show in the trainer page's fleet table."""
    from rlsync.layout import status_key
    from rlsync.protocol import read_manifest
    from rlsync.spaces.metrics import read_status

    trainer = spaces.running_or_duplicate("rl-sync-trainer", "alice/rl-sync-trainer", TOKENS["alice"])
    trainer.wait_ready()
    started = []
    for template, space_id in (("rl-sync-env", "alice/rl-sync-env"), ("rl-sync-rollout", "alice/rl-sync-rollout"),
                               ("rl-sync-rollout", "alice/rl-sync-rollout-2")):  # fmt: skip
        started.append(spaces.duplicate(template, space_id, TOKENS["alice"]))
        started[-1].wait_ready()  # one at a time: Gradio gives up on a launch it cannot reach at once on busy cores
    pages = {}
    for space, role in ((trainer, "trainer"), *zip(started, ("env", "rollout", "rollout"))):
        page = pages[space.space_id] = sign_in(browser, space, "alice")
        page.get_by_text("Signed in as alice").first.wait_for(timeout=60_000)
        start(page, role)
        wait_for(f"{space.space_id} running", lambda: "running" in text(page, f"status-{role}"), 300, [space], page=page)
    with pytest.MonkeyPatch.context() as mp:
        _point_at(mp, hub.url)
        bucket = open_hub_bucket(hub, "alice/rl-sync", TOKENS["alice"])
        manifest = wait_for("the first version", lambda: retried(lambda: read_manifest(bucket, uncached=True)),
                            FIRST_VERSION_TIMEOUT_S, spaces.running)  # fmt: skip
        ids = ("alice--rl-sync-rollout", "alice--rl-sync-rollout-2")

        def applied() -> bool:
            statuses = [retried(lambda i=i: read_status(bucket, status_key(i))) for i in ids]
            return all(s is not None and s.applied_step is not None for s in statuses)

        wait_for("both replicas applying a version", applied, FIRST_VERSION_TIMEOUT_S, spaces.running)
    assert manifest.step >= 0
    fleet = pages["alice/rl-sync-trainer"]
    wait_for("both replicas in the fleet table", lambda: all(i in text(fleet, "fleet-table") for i in ids), 120,
             spaces.running)  # fmt: skip
    assert set(hub.buckets()) == {"rlsync/rl-sync", "alice/rl-sync"}  # nothing in rlsync's, nothing of bob's


def test_a_member_of_the_panel_org_signs_in_and_starts(spaces, hub, browser) -> None:
    """carol, a member of team, signs in to team's env duplicate (PANEL_OAUTH_ORG=team) and starts it: the
    organisation's default bucket, hf://buckets/team/rl-sync, is created at that Start; Stop stops it."""
    env = spaces.duplicate("rl-sync-env", "team/rl-sync-env", TOKENS["carol"], {"PANEL_OAUTH_ORG": "team"})
    env.wait_ready()
    page = sign_in(browser, env, "carol")
    page.get_by_text("Signed in as carol").first.wait_for(timeout=60_000)
    assert "team/rl-sync" not in hub.buckets()
    start(page, "env")
    wait_for("team's env running", lambda: "running" in text(page, "status-env"), 120, [env])
    assert "team/rl-sync" in hub.buckets()
    page.get_by_role("button", name="Stop env").click()
    wait_for("team's env stopped", lambda: "stopped" in text(page, "status-env"), 120, [env])
