"""shardwise.console: the plain progress line, the bar/lines choice, the ETA and the summary block,
and shardwise.quiet's policy. Torch-free; the cadence of the lines in the loop
is tests/train/test_progress_output.py."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import warnings

import pytest

from shardwise.console import (
    GIB,
    PointsProgress,
    StepLine,
    TrainProgress,
    duration,
    format_step,
    resolve_mode,
    summary_block,
)

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


class _Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _line(**kw) -> StepLine:
    base = dict(step=10, total=60, loss=6.12345, lr=9.87e-4, grad_norm=1.44, tokens_per_s=26708.4,
                memory_bytes=0.55 * GIB)
    return StepLine(**(base | kw))


def test_the_plain_line_says_every_field_once_in_order():
    text = format_step(_line(memory_kind="GPU max allocated", mfu=0.412, eval_loss=6.2, eval_step=5,
                             elapsed_s=2.4, eta_s=8.0))
    assert text == ("train step 10/60 (17%) | loss 6.1235 | eval 6.2000 (step 5) | lr 9.87e-04 | gnorm 1.440 | "
                    "26,708 tok/s | mfu 41.2% | mem 0.55 GiB | elapsed 0:00:02 | eta 0:00:08")


def test_the_plain_line_leaves_out_what_is_unknown_and_names_host_memory():
    text = format_step(_line(memory_kind="host peak RSS"))
    assert text == "train step 10/60 (17%) | loss 6.1235 | lr 9.87e-04 | gnorm 1.440 | 26,708 tok/s | rss 0.55 GiB"
    assert "mfu" not in text and "eval" not in text and "eta" not in text


@pytest.mark.parametrize(("seconds", "text"), [(0, "0:00:00"), (8.4, "0:00:08"), (3723, "1:02:03"),
                                               (2 * 86400 + 3 * 3600 + 4 * 60 + 5, "2d 03:04:05"),
                                               (float("nan"), "?"), (float("inf"), "?")])
def test_duration(seconds, text):
    assert duration(seconds) == text


def test_auto_is_a_bar_on_a_terminal_and_lines_elsewhere():
    assert resolve_mode("auto", _Tty()) == "bar"
    assert resolve_mode("auto", io.StringIO()) == "lines"
    assert resolve_mode(True, io.StringIO()) == "lines"
    assert resolve_mode(False, _Tty()) == "off"
    assert resolve_mode("lines", _Tty()) == "lines"
    assert resolve_mode("bar", io.StringIO()) == "bar"
    with pytest.raises(ValueError, match="auto, bar, lines, off"):
        resolve_mode("fancy")


def test_lines_are_timestamped_never_redrawn_and_the_eta_follows_the_wall_clock():
    out, clock = io.StringIO(), _Clock(100.0)
    p = TrainProgress("lines", 60, stream=out, clock=clock, wall=lambda: 0.0)
    # first update: no rate yet, the step time (0.5 s) times the 50 steps left
    p.update(_line(step=10, eta_s=p.eta(10, 0.5)))
    clock.t = 120.0  # 10 more steps in 20 s: 2 s per step, 40 left
    p.update(_line(step=20, eta_s=p.eta(20, 0.5)))
    p.note("eval step 20/60 | loss 6.0000")
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert all(re.match(STAMP + " ", line) for line in lines), lines
    assert lines[0].endswith("train step 10/60 (17%) | loss 6.1235 | lr 9.87e-04 | gnorm 1.440 | 26,708 tok/s | "
                             "mem 0.55 GiB | eta 0:00:25")
    assert lines[1].endswith("| eta 0:01:20")
    assert lines[2].endswith(" eval step 20/60 | loss 6.0000")
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_off_prints_no_progress():
    out = io.StringIO()
    p = TrainProgress("off", 60, stream=out)
    p.update(_line())
    p.close()
    assert out.getvalue() == ""


def test_bench_points_as_lines():
    out, clock = io.StringIO(), _Clock(0.0)
    p = PointsProgress("lines", 2, stream=out, clock=clock)
    p.started("strategy.name=ddp", "2 rank(s), 5 steps")
    clock.t = 12.4
    p.finished("strategy.name=ddp")
    p.started("strategy.name=fsdp")
    clock.t = 15.0
    p.finished("strategy.name=fsdp", ok=False)
    lines = [line[20:] for line in out.getvalue().splitlines()]  # after the timestamp
    assert lines == ["bench point 1/2 strategy.name=ddp: running (2 rank(s), 5 steps)",
                     "bench point 1/2 strategy.name=ddp: done in 0:00:12",
                     "bench point 2/2 strategy.name=fsdp: running",
                     "bench point 2/2 strategy.name=fsdp: failed in 0:00:03"]


def test_summary_block_in_a_log_is_key_value_lines_never_wrapped():
    long = "0.48 GiB measured (host peak RSS); the plan (1.29 GiB per GPU) is for a GPU and not comparable"
    out = io.StringIO()
    summary_block("shardwise train: summary", [("status", "completed"), ("peak memory", long)], "lines", out)
    lines = out.getvalue().splitlines()
    assert re.fullmatch(STAMP + " shardwise train: summary", lines[0])
    assert lines[1:] == ["  status:      completed", f"  peak memory: {long}"]
    assert not set("┌│└─") & set(out.getvalue())


def test_summary_block_on_a_terminal_is_a_table():
    out = _Tty()
    summary_block("shardwise train: summary", [("status", "completed")], "bar", out)
    assert "status" in out.getvalue() and "completed" in out.getvalue()
    assert set("│") & set(out.getvalue())  # the rich table's frame


def test_config_progress_and_every_seconds():
    from shardwise.config.schema import LoggingSection

    assert LoggingSection().progress == "auto" and LoggingSection().every_seconds == 60.0
    assert LoggingSection(progress=True).progress == "auto"
    assert LoggingSection(progress=False).progress == "off"
    assert LoggingSection(progress="lines", every_seconds=None).every_seconds is None
    with pytest.raises(ValueError):
        LoggingSection(progress="fancy")
    with pytest.raises(ValueError):
        LoggingSection(every_seconds=0)


def test_verbose_is_inherited_and_shows_every_warning(monkeypatch):
    """--verbose exports SHARDWISE_VERBOSE=1 (spawned ranks inherit it) and lets DeprecationWarnings
    through; without it the quieted loggers are set to ERROR."""
    import logging

    from shardwise import quiet

    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    code = ("import os, warnings; from shardwise import quiet; quiet.apply({flag});"
            "print(os.environ.get('SHARDWISE_VERBOSE'));"
            "warnings.warn_explicit('old', DeprecationWarning, 'lib.py', 1, module='lib')")  # not __main__
    for flag, env_out, shown in (("True", "1", True), ("None", "None", False)):
        r = subprocess.run([sys.executable, "-c", code.format(flag=flag)], capture_output=True, text=True,
                           check=True, env={k: v for k, v in os.environ.items()
                                            if k not in ("PYTHONWARNINGS", quiet.VERBOSE_ENV)})
        assert r.stdout.strip() == env_out
        assert ("lib.py:1: DeprecationWarning: old" in r.stderr) == shown, r.stderr
    with warnings.catch_warnings():
        quiet.apply(None)
        for name, level, why in quiet.QUIET_LOGGERS:
            assert logging.getLogger(name).level == level and why


def test_transformers_bars_are_off_in_a_log():
    """from_pretrained's "Loading weights" tqdm bar (redrawn per tensor into a log) follows the
    console mode: off in a log and on ranks > 0, on for rank 0 on a terminal."""
    hf_logging = pytest.importorskip("transformers.utils.logging")
    from huggingface_hub.utils import are_progress_bars_disabled

    from shardwise.console import library_bars

    before = hf_logging.is_progress_bar_enabled()
    try:
        library_bars(False)
        assert not hf_logging.is_progress_bar_enabled() and are_progress_bars_disabled()
        library_bars(True)
        assert hf_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()
    finally:
        library_bars(before)
