"""Settings from the environment: the one helper (:mod:`rlsync.config`), and only entry points read it.

The library check reads every library module with ``ast`` (nothing is imported): a read of
``os.environ`` / ``os.getenv`` outside the entry points named in :data:`ENTRY_POINTS` fails it.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
from pathlib import Path

import pytest

from rlsync.roles import Role
from rlsync.config import from_env, settings_table
from tests.helpers import parse_module

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "shared" / "rlsync"
#: Library modules that may read the environment, and why.
ENTRY_POINTS = {
    "config.py": "the helper itself (its default mapping is os.environ)",
    "commands.py": "the rlsync command (an entry point)",
    "cli.py": "the rlsync command (an entry point)",
}
#: Shipped files that read the environment outside the config and settings modules (at most 5), and why.
DIRECT_READERS = {
    "shared/rlsync/spaces/access.py": "PANEL_AUTH and the Space's OAuth variables, read where the panel's access is decided",
    "shared/rlsync/spaces/deploy.py": "the deploy command copies the operator's token and secrets into the Spaces",
    "shared/rlsync/spaces/snapshots.py": "the token's value, to redact it from what a panel shows",
    "env_space/sources/reward_worker.py": "the reward child inherits the environment (its PYTHONPATH added)",
    "env_space/isolation.py": "the confined scorer drops every secret variable before it runs untrusted code",
}


def environment_reads(path: Path) -> list[str]:
    """``file:line`` of every read of the environment in ``path`` (writing a variable is not a read)."""
    tree = parse_module(path)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [(node.lineno, path.name) for a in node.names if a.name in ("environ", "getenv")]
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"):
            continue
        if node.attr == "getenv":
            found.append((node.lineno, path.name))
        elif node.attr == "environ":
            parent = parents.get(node)
            written = (isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store)) or (
                isinstance(parent, ast.Attribute) and parent.attr == "setdefault"
            )
            if not written:
                found.append((node.lineno, path.name))
    return [f"{name}:{line}" for line, name in sorted(found)]


def test_the_check_finds_reads_and_ignores_writes(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import os\nfrom os import getenv\na = os.environ.get('A')\nb = os.getenv('B')\nc = os.environ['C']\n"
        "d = 'D' in os.environ\nos.environ['E'] = '1'\nos.environ.setdefault('F', '1')\n"
    )
    assert environment_reads(module) == ["m.py:2", "m.py:3", "m.py:4", "m.py:5", "m.py:6"]


def test_library_modules_never_read_the_environment():
    """Library classes take their settings as arguments; only entry points read the environment."""
    offenders = []
    for path in sorted(LIBRARY.rglob("*.py")):
        relative = path.relative_to(LIBRARY).as_posix()
        if relative.startswith("spaces/") or relative in ENTRY_POINTS:
            continue
        offenders += [f"{relative}: {where}" for where in environment_reads(path)]
    assert offenders == []
    assert all((LIBRARY / name).is_file() for name in ENTRY_POINTS)  # no stale exemption


def test_at_most_five_shipped_files_read_the_environment_outside_config_and_settings_modules():
    """Every other setting goes through its component's settings class (``from_env``)."""
    shipped = [*LIBRARY.rglob("*.py"), *(ROOT / "trainer_space").rglob("*.py"), *(ROOT / "rollout_space").rglob("*.py"),
               *(ROOT / "env_space").rglob("*.py"), ROOT / "app.py"]  # fmt: skip
    readers = {
        path.relative_to(ROOT).as_posix()
        for path in shipped
        if path.name not in ("config.py", "settings.py") and environment_reads(path)
    }
    assert readers == set(DIRECT_READERS) and len(DIRECT_READERS) <= 5


# -- the helper ------------------------------------------------------------------------------------


class Color(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass
class Example:
    count: int = 1
    color: Color = Color.RED
    enabled: bool = dataclasses.field(default=True, metadata={"env": "pacing"})
    names: tuple[str, ...] = dataclasses.field(default=(), metadata={"env": None})


def test_a_field_may_name_its_variable_or_have_none():
    assert from_env(Example, "HUB", {"HUB_PACING": "off", "HUB_ENABLED": "on"}).enabled is False
    assert from_env(Example, "HUB", {"HUB_NAMES": "a,b"}).names == ()  # not settable: left alone
    assert settings_table(Example, "HUB") == [
        ("HUB_COUNT", "1", ""), ("HUB_COLOR", repr(Color.RED), ""), ("HUB_PACING", "True", ""),
    ]  # fmt: skip


def test_later_prefixes_win():
    env = {"HUB_COUNT": "2", "ROLLOUT_HUB_COUNT": "3", "HUB_COLOR": "BLUE"}
    assert from_env(Example, ("HUB", "ROLLOUT_HUB"), env) == Example(count=3, color=Color.BLUE)
    assert from_env(Example, ("HUB", "ENV_HUB"), env).count == 2
    assert from_env(Example, ("HUB", "ROLLOUT_HUB"), env, count=7).count == 7  # overrides win


@pytest.mark.parametrize("var,value", [("HUB_COUNT", "many"), ("ROLLOUT_HUB_PACING", "maybe"), ("HUB_COLOR", "green")])
def test_a_bad_value_names_its_variable(var, value):
    with pytest.raises(ValueError, match=var):
        from_env(Example, ("HUB", "ROLLOUT_HUB"), {var: value})


def test_bucket_settings_read_every_documented_name():
    from rlsync.bucket import BucketSettings
    from rlsync.bucket.budget import BudgetConfig, Tier
    from rlsync.bucket.hf_transport import HfTransferConfig
    from rlsync.bucket.watch import WatchConfig

    env = {
        "HF_BUCKET_CONNECT_TIMEOUT": "3", "HF_BUCKET_READ_TIMEOUT": "4", "HUB_TIER": "pro", "HUB_SHARE": "5",
        "HUB_TARGET": "0.5", "HUB_WINDOW_S": "30", "HUB_PACING": "0", "HUB_FEED": "0", "HUB_MIN_POLL_S": "2",
        "HUB_MAX_POLL_S": "8", "ENV_HUB_SHARE": "9", "ENV_HUB_FEED": "1",
    }  # fmt: skip
    plain = BucketSettings.from_env(environ=env)
    assert (plain.transfer.connect_timeout, plain.transfer.read_timeout) == (3.0, 4.0)
    budget = plain.budget
    assert (budget.tier, budget.share, budget.target, budget.window_s, budget.enabled) == (Tier.PRO, 5, 0.5, 30.0, False)
    assert (plain.watch.feed, plain.watch.min_poll_s, plain.watch.max_poll_s) == (False, 2.0, 8.0)
    env_role = BucketSettings.from_env(Role.ENV, env)
    assert (env_role.budget.share, env_role.watch.feed, env_role.role) == (9, True, Role.ENV)
    defaults = BucketSettings.from_env(environ={})
    assert (defaults.transfer, defaults.budget, defaults.watch) == (HfTransferConfig(), BudgetConfig(), WatchConfig())


def test_open_bucket_gives_a_hub_bucket_its_settings(monkeypatch):
    from rlsync.bucket import BucketSettings, open_bucket
    from rlsync.bucket.budget import BudgetConfig

    monkeypatch.setenv("HUB_SHARE", "11")  # not read: only the settings passed count
    settings = BucketSettings(budget=BudgetConfig(share=3, enabled=False), role=Role.ROLLOUT)
    hub = open_bucket("hf://buckets/someone/rl-sync", create=False, settings=settings).inner
    assert hub.meter.config == settings.budget and hub.meter.role is Role.ROLLOUT
    assert open_bucket("hf://buckets/someone/rl-sync", create=False).inner.meter.config.share == BudgetConfig().share


def test_the_trainer_space_not_the_publisher_reads_space_id(tmp_path, monkeypatch):
    import socket

    from rlsync.bucket import LocalBucket
    from rlsync.protocol import Publisher
    from rlsync.spaces.settings import space_owner

    monkeypatch.setenv("SPACE_ID", "me/trainer")
    assert space_owner() == "me/trainer"
    assert Publisher(LocalBucket(tmp_path / "b")).ownership.owner == socket.gethostname()
    assert Publisher(LocalBucket(tmp_path / "b"), owner=space_owner()).ownership.owner == "me/trainer"
    monkeypatch.delenv("SPACE_ID")
    assert space_owner() == socket.gethostname()


def test_a_role_is_a_role_member_never_a_plain_string():
    from rlsync.bucket import BucketSettings
    from rlsync.layout import ROLE_READS

    assert set(ROLE_READS) == set(Role) and [r.env_prefix for r in Role] == ["TRAINER", "ROLLOUT", "ENV"]
    assert BucketSettings.from_env(Role.ROLLOUT, {"ROLLOUT_HUB_SHARE": "4"}).budget.share == 4
    with pytest.raises(TypeError, match="must be a Role"):
        BucketSettings.from_env("rollout", {})  # a name from outside is parsed first: Role("rollout")
    with pytest.raises(ValueError, match="not a valid Role"):
        Role("replica")
