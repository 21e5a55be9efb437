"""A processor without a feature a path needs: that path refuses at start with one line, on every CPU.

The FP8 chain is served by vLLM's CPU block-FP8 kernel, which needs AMX tiles. Here the processor's features
are set (``rlsync.cpu.has_feature``), so each case runs on any machine: the rollout replica, its panel's
Start and ``python -m rlsync.vllm.serve`` refuse before any model is built or loaded, with a line that names
what is missing and what to use instead. docs/testing.md lists the tests that follow the real processor.
"""

from __future__ import annotations

import pytest

from rlsync import cpu
from rlsync.cpu import CpuFeature
from rlsync.errors import ConfigurationError, UnsupportedHardwareError
from rlsync.roles import Role
from rlsync.spaces.role_control import RoleRunner
from rlsync.vllm import serve, support

EVERY_FEATURE = frozenset(CpuFeature)
NO_AMX = EVERY_FEATURE - {CpuFeature.AMX_TILE}  # an AMD EPYC or an Intel before Sapphire Rapids
AVX2_ONLY = frozenset({CpuFeature.AVX2, CpuFeature.BMI2})


@pytest.fixture
def features(monkeypatch):
    """Set the processor's features: ``features(NO_AMX)``."""

    def set_features(found: frozenset[CpuFeature]) -> None:
        monkeypatch.setattr(cpu, "has_feature", lambda feature: feature in found)

    return set_features


def test_the_processors_features_are_read(features):
    found = cpu.cpu_features()
    assert found == {f for f in CpuFeature if cpu.has_feature(f)}
    assert found <= EVERY_FEATURE and cpu.cpu_name()
    if cpu.is_x86_64():  # every x86-64 machine CI runs on has AVX2; torch and LLVM agree on it
        assert CpuFeature.AVX2 in found
    features(NO_AMX)
    assert cpu.missing_features(CpuFeature.AMX_TILE, CpuFeature.AVX2, CpuFeature.BMI2) == [CpuFeature.AMX_TILE]



@pytest.mark.parametrize(("host", "bmi2", "fast"), [("znver2", True, False), ("znver3", True, True), ("skylake", True, True), ("znver3", False, False)])
def test_pdep_counts_as_fast_only_where_it_is_not_microcoded(features, monkeypatch, host, bmi2, fast):
    """AMD before Zen 3 has BMI2 but a microcoded ``pdep`` (hundreds of cycles): the classrice decoder, which
    deposits a dozen masks per 64 elements, then takes its search instead (``rlsync.bitops.HAS_PDEP``)."""
    from llvmlite import binding as llvm

    features(EVERY_FEATURE if bmi2 else EVERY_FEATURE - {CpuFeature.BMI2})
    monkeypatch.setattr(llvm, "get_host_cpu_name", lambda: host)
    cpu.has_fast_pdep.cache_clear()
    try:
        assert cpu.has_fast_pdep() is fast
    finally:
        cpu.has_fast_pdep.cache_clear()

@pytest.mark.parametrize(
    ("found", "missing"),
    [(EVERY_FEATURE, None), (NO_AMX, ["AMX tiles"]), (AVX2_ONLY, ["AMX tiles", "AVX-512 BF16"])],
    ids=["amx", "no-amx", "avx2-only"],
)
def test_the_fp8_refusal_names_what_is_missing_and_what_to_use_instead(features, found, missing):
    features(found)
    line = support.fp8_serving_refusal("cpu")
    if missing is None:
        assert line is None
        support.check_fp8_serving("cpu")
        return
    assert "\n" not in line and all(m in line for m in missing) and "ROLLOUT_CHAIN=bf16" in line and "GPU" in line
    assert cpu.cpu_name() in line
    with pytest.raises(UnsupportedHardwareError, match="ROLLOUT_CHAIN=bf16") as refused:
        support.check_fp8_serving("cpu")
    assert isinstance(refused.value, ConfigurationError) and str(refused.value) == line


@pytest.fixture
def loads(monkeypatch):
    """Record every model build, FP8 conversion and engine start a replica makes."""
    import rollout_space.replica as replica

    calls = []
    for name in ("write_fp8_checkpoint", "create_engine", "model_or_default", "open_role_bucket"):
        monkeypatch.setattr(replica, name, lambda *a, _name=name, **k: calls.append(_name))
    return calls


@pytest.mark.parametrize("engine", ["auto", "vllm"])
def test_an_fp8_replica_refuses_before_it_loads_anything(features, loads, tmp_path, engine):
    from rollout_space.replica import Replica, ReplicaConfig

    features(NO_AMX)
    config = ReplicaConfig(bucket=str(tmp_path / "bucket"), engine=engine, chain="fp8", device="cpu")
    with pytest.raises(UnsupportedHardwareError) as refused:
        Replica(config)
    assert str(refused.value) == support.fp8_serving_refusal("cpu")
    assert loads == [] and not (tmp_path / "bucket").exists()  # no model, no engine, not even the bucket


def test_the_rollout_panel_shows_the_refusal_as_its_failure(features, loads, tmp_path):
    """What the rollout panel's Start shows: "failed: <the line>", not a traceback, not "running"."""
    from rollout_space.app import build_replicas
    from rollout_space.replica import ReplicaConfig

    features(NO_AMX)
    runner = RoleRunner(Role.ROLLOUT, build_replicas)
    runner.start(ReplicaConfig(bucket=str(tmp_path / "bucket"), chain="fp8", device="cpu"), wait=True)
    line = support.fp8_serving_refusal("cpu")
    assert runner.state == "failed" and runner.error == line
    assert runner.status().endswith(f": failed: {line}") and "Traceback" not in runner.status()
    assert loads == []


def test_a_bf16_replica_is_not_refused_without_amx(features, tmp_path, monkeypatch):
    import rollout_space.replica as replica

    class EngineBuilt(Exception):
        pass

    def create_engine(kind, **kwargs):
        raise EngineBuilt(kind)

    monkeypatch.setattr(replica, "create_engine", create_engine)
    features(AVX2_ONLY)
    config = replica.ReplicaConfig(bucket=str(tmp_path / "bucket"), engine="auto", chain="bf16", device="cpu")
    with pytest.raises(EngineBuilt, match="transformers"):  # past every check, to the engine the CPU runs
        replica.Replica(config)


def _fp8_model(tmp_path):
    from rlsync.fp8 import write_fp8_checkpoint
    from rlsync.spaces.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", seed=0, config_overrides={"num_key_value_heads": 4})
    return model, write_fp8_checkpoint(model, tmp_path / "fp8")


def test_vllm_serve_refuses_an_fp8_model_on_a_cpu_without_the_kernel(features, tmp_path, monkeypatch):
    bf16, fp8 = _fp8_model(tmp_path)
    monkeypatch.setattr(serve, "vllm_version", lambda: "0.32.0+cpu")
    monkeypatch.delenv("ROLLOUT_CHAIN", raising=False)
    started = []
    monkeypatch.setattr(serve, "_answer_vllm_version", lambda: started.append(True))  # vLLM's own start follows it
    features(NO_AMX)
    assert serve.is_block_fp8(str(fp8)) and not serve.is_block_fp8(str(bf16)) and not serve.is_block_fp8("Qwen/Qwen3-0.6B")
    with pytest.raises(SystemExit, match="^rlsync.vllm.serve: the FP8 chain cannot be served on this CPU") as refused:
        serve.main([str(fp8), "--port", "0"])
    assert str(refused.value).endswith(support.INSTEAD) and started == []
    assert serve.serving_refusal([str(bf16)]) is None
    monkeypatch.setenv("ROLLOUT_CHAIN", "fp8")  # the chain asked for by the environment, whatever the folder
    assert serve.serving_refusal([str(bf16)]) == support.fp8_serving_refusal("cpu")
    monkeypatch.setattr(serve, "vllm_version", lambda: "0.32.0")  # vLLM's GPU build chooses among its own kernels
    assert serve.serving_refusal([str(fp8)]) is None
    features(EVERY_FEATURE)
    monkeypatch.setattr(serve, "vllm_version", lambda: "0.32.0+cpu")
    assert serve.serving_refusal([str(fp8)]) is None


def test_the_serve_check_imports_neither_numba_nor_llvmlite():
    """``python -m rlsync.vllm.serve`` checks the processor before vLLM starts its workers; vLLM 0.32's CPU
    kernel-override scan fails in every worker once ``llvmlite.binding`` is imported (it did once here)."""
    import subprocess
    import sys

    code = (
        "import sys; from rlsync.vllm import serve, support; support.fp8_serving_refusal('cpu'); "
        "serve.is_block_fp8('.'); print(sorted(m for m in ('numba', 'llvmlite', 'rlsync.protocol') if m in sys.modules))"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip() == "[]"
