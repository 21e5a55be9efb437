"""The newcomer test: each extension is one new file in its kind's home (:mod:`rlsync.registry`), and everything that
takes a name of that kind takes the new one with no other edit: a codec, a bucket backend, an anchor policy with its
own settings, a rollout engine (an env source: ``tests/spaces_support/test_env_source_registry.py``).

The files are written into a scratch package of their own (not into the source tree, which other tests read at the
same time) added as a home, exactly as ``rlsync.codecs`` or ``rollout_space.engines`` are.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from rlsync.bucket import open_bucket
from rlsync.hashing import state_hash
from rlsync.protocol import FixedInterval, Publisher, Subscriber
from rollout_space.config import ReplicaConfig  # imported before the scratch entries: their help lists the tree's
from tests.helpers import bf16, master_state, rl_step
from trainer_space.config import TrainerConfig

FILES = {
    "wide_codec.py": '''
        """A codec storing every position as int64 (the trl layout, without its int32 narrowing)."""

        import numpy as np
        import torch

        from rlsync.codecs.base import EncodedTensor
        from rlsync.codecs.trl import TrlCodec
        from rlsync.registry import Kind, register

        register(Kind.CODEC, "wide", "newcomer.wide_codec:WideCodec", summary="int64 positions, raw values")


        class WideCodec(TrlCodec):
            name = "wide"

            def encode(self, name, index, old_bits, new_bits, *, base=None):
                signed = new_bits.view(np.dtype(f"int{8 * new_bits.itemsize}"))
                entries = {f"{name}.indices": torch.from_numpy(index.astype(np.int64)),
                           f"{name}.values": torch.from_numpy(np.ascontiguousarray(signed))}
                return EncodedTensor(entries=entries, params={})
    ''',
    "memory_bucket.py": '''
        """A bucket in this process's memory: ``mem://NAME`` (one store per name)."""

        from rlsync.bucket.base import Bucket, Capability, ObjectInfo, validate_key
        from rlsync.errors import ObjectNotFoundError
        from rlsync.registry import Kind, register

        register(Kind.BUCKET, "mem", "newcomer.memory_bucket:open_memory", capabilities=("conditional_writes",),
                 summary="objects in this process's memory")

        STORES = {}


        class MemoryBucket(Bucket):
            capabilities = Capability.declared("mem")

            def __init__(self, url):
                self.url, self.objects = url, STORES.setdefault(url, {})

            def put(self, key, data):
                self.objects[validate_key(key)] = bytes(data)

            def get(self, key):
                try:
                    return self.objects[validate_key(key)]
                except KeyError:
                    raise ObjectNotFoundError(key) from None

            def list(self, prefix=""):
                return [ObjectInfo(k, len(v)) for k, v in sorted(self.objects.items()) if k.startswith(prefix)]

            def delete(self, keys):
                for key in keys:
                    self.objects.pop(key, None)


        def open_memory(url, *, create=True, settings=None):
            return MemoryBucket(url)
    ''',
    "every_policy.py": '''
        """An anchor every ``period`` publishes, counted from ``offset``: a policy with settings of its own."""

        import dataclasses

        from rlsync.protocol.policies.base import AnchorPolicy
        from rlsync.registry import Kind, register

        register(Kind.ANCHOR_POLICY, "every", "newcomer.every_policy:Every", settings="newcomer.every_policy:Every")


        @dataclasses.dataclass
        class Every(AnchorPolicy):
            period: int = dataclasses.field(default=3, metadata={"label": "Period (publishes)", "minimum": 1})
            offset: int = dataclasses.field(default=0, metadata={"label": "Offset", "minimum": 0})
            name = "every"

            def wants_anchor(self, manifest):
                return (manifest.step + 1 - self.offset) % self.period == 0

            def describe(self):
                return f"every {self.period} from {self.offset}"
    ''',
    "echo_engine.py": '''
        """An engine that answers with the prompt (it runs on any device)."""

        from rlsync.registry import Kind, register

        register(Kind.ENGINE, "echo", "newcomer.echo_engine:EchoEngine", capabilities=("device",), summary="echoes")


        class EchoEngine:
            name = "echo"

            def __init__(self, model_path, *, device):
                self.model_path, self.device = model_path, device
    ''',
}


@pytest.fixture
def newcomer(tmp_path, monkeypatch, scratch_registry):
    """The registry with the scratch package ``newcomer`` as a home: one file per extension, nothing else."""
    package = tmp_path / "newcomer"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, text in FILES.items():
        (package / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    scratch_registry.add_home("newcomer")
    yield scratch_registry
    for name in [m for m in sys.modules if m == "newcomer" or m.startswith("newcomer.")]:
        del sys.modules[name]


def test_a_codec_in_one_file_publishes_and_syncs_bit_exactly(newcomer, bucket):
    from rlsync.cli import build_parser
    from rlsync.codecs import list_codecs

    assert "wide" in list_codecs() and TrainerConfig(codec="wide").codec == "wide"
    assert build_parser().parse_args(["diff", "a", "b", "-o", "c", "--codec", "wide"]).codec == "wide"
    master = master_state()
    pub, sub = Publisher(bucket, policy=FixedInterval(10), codec="wide"), Subscriber(bucket)
    pub.publish(0, master)
    rl_step(master, 1)
    record = pub.publish(1, master)
    assert record.kind == "delta" and [u.step for u in sub.sync()] == [0, 1]
    assert sub.state_hash == state_hash(bf16(master)) == record.state_hash


def test_a_bucket_backend_in_one_file_opens_by_url_and_carries_a_run(newcomer):
    from rlsync.bucket import Capability

    bucket = open_bucket("mem://run")
    assert bucket.capabilities == {Capability.CONDITIONAL_WRITES} and "mem" in newcomer.names("bucket")
    master = master_state()
    Publisher(bucket, policy=FixedInterval(10)).publish(0, master)
    follower = Subscriber(open_bucket("mem://run"))
    assert [u.kind for u in follower.sync()] == ["anchor"] and follower.state_hash == state_hash(bf16(master))


def test_an_anchor_policy_with_its_own_settings_in_one_file(newcomer):
    from rlsync.protocol.policy import policy_from_json, policy_names, policy_to_json
    from rlsync.spaces.anchor_policy import make_policy, setting_fields

    every = newcomer.get("anchor_policy", "every").settings_class()
    assert "every" in policy_names() and policy_from_json(policy_to_json(every(4, 1))) == every(4, 1)
    assert {"period", "offset"} <= {f.name for f in setting_fields()}  # two inputs on the panels' form
    assert make_policy("every", {"period": 5.0, "offset": 2.0}) == every(5, 2)
    assert TrainerConfig(anchor_policy="every", anchor_settings='{"period": 7, "offset": 1}').policy() == every(7, 1)


def test_an_engine_in_one_file_is_chosen_by_its_name_and_given_what_it_declares(newcomer):
    from rollout_space.engine import EngineCapability, choose_engine, create_engine
    from rlsync.errors import ConfigurationError

    assert ReplicaConfig(engine="echo").engine == "echo"
    entry = choose_engine("echo", "cpu", fp8=False)
    assert entry.has(EngineCapability.DEVICE) and not entry.has(EngineCapability.FP8)
    engine = create_engine("echo", model_path="m", device=torch.device("cpu"))
    assert (engine.name, engine.device) == ("echo", torch.device("cpu"))
    with pytest.raises(ConfigurationError, match="ROLLOUT_CHAIN=fp8 is served by ROLLOUT_ENGINE=vllm, not 'echo'"):
        choose_engine("echo", "cpu", fp8=True)
