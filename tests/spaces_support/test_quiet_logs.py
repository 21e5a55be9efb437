"""Quiet terminal output (issue 31): TRL's per-step lines at DEBUG, one summary line per interval per role.

``python app.py`` printed about 3,000 lines in 200 s: five TRL weight-sync lines and a ~40-key metrics
dict per optimizer step, a line per applied version per replica, per publish and per task batch.
"""

from __future__ import annotations

import logging

import pytest
from accelerate.logging import get_logger

from rlsync.spaces.interval_log import IntervalLog
from rlsync.trl.logs import TRL_TRAINER_LOGGER, quiet_trl_lines


@pytest.fixture
def trl_lines(caplog):
    quiet_trl_lines()
    from accelerate import PartialState

    PartialState()  # accelerate's logger needs its state
    return get_logger(TRL_TRAINER_LOGGER)


@pytest.mark.parametrize("line", ["Weight sync: pausing vLLM...", "dropping stale sample (staleness=3, max=2)", "waited 1.5s for sample (qsize=31)"])
def test_trl_step_lines_are_debug_lines(trl_lines, caplog, line):
    caplog.set_level(logging.INFO)
    trl_lines.info(line)  # "[RANK 0] ..." once accelerate has prefixed it
    trl_lines.warning("a real warning stays")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING", "[RANK 0] a real warning stays")]
    caplog.clear()
    caplog.set_level(logging.DEBUG)
    trl_lines.info(line)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("DEBUG", f"[RANK 0] {line}")]


def test_one_line_per_interval_and_none_for_an_idle_one(caplog):
    caplog.set_level(logging.INFO)
    clock = [0.0]
    render = lambda counts, latest, seconds: f"did {counts['steps']:g} in {seconds:g}s (v{latest['v']})"  # noqa: E731
    log = IntervalLog(logging.getLogger("role"), render, every_s=10, clock=lambda: clock[0])
    for t in range(25):
        clock[0] = float(t)
        log.add(steps=1)
        log.note(v=t)
        log.flush()
    clock[0] = 40.0
    log.flush()
    clock[0] = 60.0
    log.flush()  # nothing counted since the last line: no line
    log.flush(force=True)
    assert [r.getMessage() for r in caplog.records] == ["did 11 in 10s (v10)", "did 10 in 10s (v20)", "did 4 in 20s (v24)"]
