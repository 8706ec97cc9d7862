"""What a batch log of `shardwise train` holds.

- The piped output (stdout and stderr into one pipe, not a TTY) of the bundled demos, 60 steps on
  2 CPU ranks, under FSDP2 (examples/demo.yaml), ZeRO-3 (the same with strategy.name=zero3) and
  LoRA (examples/lora-demo.yaml, ZeRO-3 with checkpoints and a merged export): at least 5
  timestamped progress lines with the step and the loss, no line cut with "…", no carriage return
  or ANSI code, the summary block, and at most 10 warning lines (before: 0, 484 and 246). One run
  per demo, shared by the tests (a file lock: once per session however xdist distributes them).
- The cadence, in process on one rank: `logging.every_seconds` makes every boundary a logging
  step once its time has passed (the loop's timed-log vote), and the progress line shows the
  newest step of each flush; the StepLog's clock rule with a fake clock.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEMO_STEPS, TIMEOUT_S
from filelock import FileLock
from one_rank import loop_config, train_one_rank

REPO = Path(__file__).resolve().parents[2]
STEPS = DEMO_STEPS
DEMOS = {
    "fsdp": ("examples/demo.yaml", []),
    "zero3": ("examples/demo.yaml", ["strategy.name=zero3"]),
    "lora": ("examples/lora-demo.yaml", []),
}
PROGRESS = re.compile(rf"^\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d train step (\d+)/{STEPS} \(\d+%\) \| loss (\d+\.\d{{4}}) \|")
PY_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")  # file:line: Category: message, then the source line


def warning_lines(text: str) -> list[str]:
    """Every line that says 'warn' (Python's `...Warning:`, logging's `[WARNING]`, `warnings.warn(`)
    and the source line Python prints under each warning."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if "warn" in line.lower():
            out.append(line)
        elif i and PY_WARNING.match(lines[i - 1]):
            out.append(line)
    return out


@pytest.fixture(scope="module")
def piped(shared_dir, demo_run) -> dict[str, str]:
    """Each demo's combined stdout+stderr through a pipe, run once per session (the FSDP2 and
    ZeRO-3 demos are conftest's `demo_run`, shared with the end-to-end tests)."""
    texts = {name: demo_run(name)["log"] for name in ("fsdp", "zero3")}
    config, sets = DEMOS["lora"]
    out = shared_dir / "piped-lora"
    log = shared_dir / "piped-lora.log"
    with FileLock(str(out) + ".lock"):
        if not log.exists():
            args = [a for s in [f"run.steps={STEPS}", f"checkpointing.output_dir={out}", *sets] for a in ("--set", s)]
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "SHARDWISE_VERBOSE")}
            r = subprocess.run([sys.executable, "-m", "shardwise.train.cli", str(REPO / config), *args],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                               timeout=TIMEOUT_S, check=False, env={**env, "DS_ACCELERATOR": "cpu"})
            assert r.returncode == 0, r.stdout[-4000:]
            log.write_text(r.stdout)
    texts["lora"] = log.read_text()
    return texts


@pytest.mark.distributed
@pytest.mark.parametrize("demo", list(DEMOS))
def test_a_piped_demo_logs_progress_lines_whole_and_few_warnings(piped, demo):
    text = piped[demo]
    progress = [m for line in text.splitlines() if (m := PROGRESS.match(line))]
    from shardwise.config.load import load_config

    config, sets = DEMOS[demo]
    every = load_config(REPO / config, sets).logging.every
    # one line per logging step (every `logging.every`-th) and one at the last step
    assert [int(m.group(1)) for m in progress] == sorted({*range(every, STEPS + 1, every), STEPS}), text[-3000:]
    assert all(0 < float(m.group(2)) < 20 for m in progress)
    assert "…" not in text and "\r" not in text and "\x1b" not in text
    assert re.search(r"shardwise train: summary\n  status: +completed\n", text), text[-2000:]
    warned = warning_lines(text)
    print(f"{demo}: {len(progress)} progress lines, {len(warned)} warning lines")
    assert len(warned) <= 10, "\n".join(warned[:40])


# --- the cadence, in process --------------------------------------------------------------------


class _Shown:
    """The metrics side of the loop: which records were logged and which were shown."""

    def __init__(self):
        self.logged, self.shown = [], []

    def start(self, *args, **kwargs):
        pass

    def log_step(self, rec):
        self.logged.append(rec.step)

    def show(self, rec):
        self.shown.append(rec.step)


def test_every_seconds_makes_each_boundary_a_logging_step_and_the_line_shows_the_newest(tmp_path):
    from shardwise.config.schema import TrainConfig

    steps_only = _Shown()
    train_one_rank(loop_config(tmp_path / "a", every=3), metrics=steps_only)
    assert steps_only.shown == [3, 6, 7]  # every 3 steps and the last
    cfg = loop_config(tmp_path / "b", every=100)
    timed_cfg = TrainConfig.model_validate(cfg.model_dump() | {"logging": cfg.logging.model_dump()
                                                               | {"every_seconds": 1e-6}})
    timed = _Shown()
    train_one_rank(timed_cfg, metrics=timed)
    assert timed.logged == list(range(1, 8))
    assert timed.shown == list(range(1, 8))  # every_seconds passed at every boundary


def test_the_clock_rule_of_the_logging_interval():
    from shardwise.train.observe.step_log import Guard, StepLog, StepRecord

    now = [0.0]
    shown = []
    log = StepLog(100, Guard(0, False), lambda sums: sums, lambda rec: None, every_seconds=30.0,
                  show=shown.append, clock=lambda: now[0])

    def add(step):
        log.add(StepRecord(step=step, loss=0.0, grad_norm=0.0, lr=1e-3, target_tokens=10, tokens=10,
                           step_time_s=1.0), 20.0, 1.0)

    now[0] = 29.9
    assert not log.time_due()
    now[0] = 31.0
    assert log.time_due()
    add(1)
    log.flush()
    assert [r.step for r in shown] == [1] and shown[0].loss == 2.0
    add(2)
    now[0] = 60.9  # 29.9 s since the flush at 31
    assert not log.time_due()
    add(3)
    now[0] = 61.0
    assert log.time_due()
    log.flush()
    assert [r.step for r in shown] == [1, 3]  # the newest record of each flush
    assert not StepLog(100, Guard(0, False), lambda s: s, lambda r: None).time_due()  # every_seconds None
