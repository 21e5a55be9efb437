"""One registry for the six extension points (rlsync.registry): entries are read from their homes' files without
importing them, imported on first use, refused when a name is taken, and buckets are followed by what they declare."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rlsync.bucket import Bucket, Capability, LocalBucket, backend_of, open_bucket
from rlsync.bucket.retry import RetryingBucket
from rlsync.bucket.watch import WatchConfig, WatchedBucket, WatchMode, meter_of, watch
from rlsync.errors import BucketError, ConfigurationError, UnknownNameError


def test_every_kind_is_listed_without_importing_what_its_entries_need():
    code = textwrap.dedent("""
        import sys
        import env_space, env_space.sources, rollout_space
        from rlsync import registry
        print({kind.value: registry.names(kind) for kind in registry.Kind})
        print(sorted(m for m in ("torch", "huggingface_hub", "boto3", "vllm", "reasoning_gym", "datasets") if m in sys.modules))
    """)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    listed = eval(out[0])  # noqa: S307 - our own child's dict
    assert listed == {
        "codec": ["classgap", "classrice", "gapzz", "trl"], "bucket": ["file", "hf", "s3"],
        "anchor_policy": ["adaptive", "fixed"], "env_source": ["dataset", "openenv", "reasoning_gym"],
        "environment": ["arithmetic", "reverse"], "engine": ["transformers", "vllm"],
    }  # fmt: skip
    assert out[1] == "[]"


def test_a_home_file_is_read_not_imported_and_its_target_loads_on_first_use(scratch_registry, tmp_path, monkeypatch):
    package = tmp_path / "scratch_home"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "thing.py").write_text(textwrap.dedent("""
        from rlsync.registry import Kind, register

        register(Kind.CODEC, "scratch", "scratch_home.thing:VALUE", capabilities=("accelerator",), summary="a test")
        VALUE = object()
    """))  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    scratch_registry.add_home("scratch_home")
    try:
        entry = scratch_registry.get("codec", "scratch")
        assert "scratch_home.thing" not in sys.modules and entry.has("accelerator") and entry.summary == "a test"
        assert entry.load() is sys.modules["scratch_home.thing"].VALUE  # imported now; its own register() is harmless
        assert scratch_registry.get("codec", "scratch").load() is entry.load()
    finally:
        for name in [m for m in sys.modules if m.startswith("scratch_home")]:
            del sys.modules[name]


def test_a_registration_with_a_computed_argument_is_refused_with_its_line(scratch_registry, tmp_path, monkeypatch):
    package = tmp_path / "bad_home"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "bad.py").write_text('from rlsync.registry import Kind, register\n\nregister(Kind.CODEC, "x", NAME)\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    scratch_registry.add_home("bad_home")
    with pytest.raises(ConfigurationError, match=r"bad\.py:3: register\(\) takes literal arguments"):
        scratch_registry.names("codec")


def test_unknown_names_are_configuration_and_key_errors_that_list_the_known_ones():
    from rlsync.registry import check_choice, get

    with pytest.raises(UnknownNameError, match="^unknown codec 'zip'; known: classgap, classrice, gapzz, trl$") as info:
        get("codec", "zip")
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    with pytest.raises(UnknownNameError, match="TRAINER_CODEC='zip' names no codec; use one of auto, classgap"):
        check_choice("codec", "zip", "TRAINER_CODEC", also=("auto",))
    with pytest.raises(BucketError, match="one of file://, hf://"):
        open_bucket("s4://somewhere")


class _Metered(LocalBucket):
    """A local folder that says its requests cost (as a Hub bucket does), with a meter."""

    capabilities = frozenset({Capability.METERED})

    def __init__(self, root) -> None:
        super().__init__(root)
        self.meter = object()


def test_watch_and_metering_follow_what_the_backend_declares(tmp_path):
    local = RetryingBucket(LocalBucket(tmp_path / "free"))
    assert watch(local) is local and meter_of(local) is None  # a local folder lists for free
    metered = _Metered(tmp_path / "metered")
    watched = watch(RetryingBucket(metered), WatchConfig(feed=True))
    try:
        assert isinstance(watched, WatchedBucket) and backend_of(watched) is metered
        assert meter_of(watched) is metered.meter
        assert watched.mode is WatchMode.POLL  # feed asked for, but the backend declares none
    finally:
        watched.close()


def test_the_hub_backend_declares_its_capabilities_in_its_registration():
    from rlsync.bucket.hf import HfBucket

    assert HfBucket.capabilities == {Capability.METERED, Capability.CHANGE_FEED, Capability.SIZE_LIMITED_READS}
    assert LocalBucket.capabilities == {Capability.SIZE_LIMITED_READS} and Bucket.capabilities == frozenset()
