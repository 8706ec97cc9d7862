"""What `train` and `bench` print while they run: one source, two modes.

- **bar**: on a terminal, rich progress bars redrawn in place (train: steps; bench: points).
- **lines**: when stdout is not a terminal (sbatch, nohup, a Kubernetes job, a pipe), plain
  timestamped lines, one per update, never redrawn (no ANSI codes, no carriage returns) and never
  cut: what a batch log can hold and `grep` can read.

`logging.progress` picks the mode: `auto` (bar on a TTY, lines otherwise), `bar`, `lines` or
`off`. The train loop decides *when* (shardwise.train.observe.step_log: every `logging.every` steps or
`logging.every_seconds`, whichever comes first); this module decides *how*. A final summary block
is printed in either mode (a rich table on a terminal, `key: value` lines otherwise).

Torch-free and small: rich is imported only for the bar mode.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TextIO

from shardwise.numfmt import rate

Mode = Literal["bar", "lines", "off"]
PROGRESS_SETTINGS = ("auto", "bar", "lines", "off")
GIB = 1024**3


def resolve_mode(setting: str | bool, stream: TextIO | None = None) -> Mode:
    """`logging.progress` (auto / bar / lines / off; true = auto, false = off) for `stream`
    (stdout): `auto` is a bar on a terminal and lines anywhere else."""
    if setting is True or setting == "auto":
        s = sys.stdout if stream is None else stream
        try:
            return "bar" if s.isatty() else "lines"
        except (AttributeError, ValueError):  # closed or not a file
            return "lines"
    if setting is False or setting == "off":
        return "off"
    if setting in ("bar", "lines"):
        return setting  # type: ignore[return-value]
    raise ValueError(f"progress mode {setting!r}: expected one of {', '.join(PROGRESS_SETTINGS)}")


def stamp(now: float | None = None) -> str:
    """Local wall-clock time as a log line starts with it: `2026-12-02 06:14:50`."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))


def say(text: str, stream: TextIO | None = None, now: float | None = None) -> None:
    """One timestamped line, flushed (a batch log shows it at once)."""
    print(f"{stamp(now)} {text}", file=sys.stdout if stream is None else stream, flush=True)


def duration(seconds: float) -> str:
    """`0:00:08`, `1:02:03`, `2d 03:04:05`; `?` when unknown."""
    if seconds != seconds or seconds < 0 or seconds == float("inf"):
        return "?"
    s = round(seconds)
    days, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{days}d {h:02d}:{m:02d}:{s:02d}" if days else f"{h}:{m:02d}:{s:02d}")


@dataclass(frozen=True)
class StepLine:
    """What one progress update says about a training step."""

    step: int
    total: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    memory_bytes: float
    memory_kind: str = "GPU max allocated"  # or "host peak RSS"
    mfu: float | None = None
    eval_loss: float | None = None
    eval_step: int | None = None
    elapsed_s: float | None = None
    eta_s: float | None = None


def step_fields(s: StepLine) -> list[str]:
    """The fields of a step's update, in order (the bar shows them after its bar, a line after
    `step N/T`)."""
    mem = "rss" if s.memory_kind.startswith("host") else "mem"
    out = [f"loss {s.loss:.4f}"]
    if s.eval_loss is not None:
        out.append(f"eval {s.eval_loss:.4f}" + (f" (step {s.eval_step})" if s.eval_step is not None else ""))
    out += [f"lr {s.lr:.2e}", f"gnorm {s.grad_norm:.3f}", f"{rate(s.tokens_per_s)} tok/s"]
    if s.mfu is not None:
        out.append(f"mfu {s.mfu:.1%}")
    out.append(f"{mem} {s.memory_bytes / GIB:.2f} GiB")
    return out


def format_step(s: StepLine) -> str:
    """A training step as one plain line (without the timestamp):
    `train step 10/60 (17%) | loss 6.1234 | eval 6.2000 (step 5) | lr 9.87e-04 | gnorm 1.440 |
    26,708 tok/s | mfu 41.2% | mem 0.55 GiB | elapsed 0:00:02 | eta 0:00:08`."""
    pct = f" ({s.step / s.total:.0%})" if s.total else ""
    parts = [f"train step {s.step}/{s.total}{pct}", *step_fields(s)]
    if s.elapsed_s is not None:
        parts.append(f"elapsed {duration(s.elapsed_s)}")
    if s.eta_s is not None:
        parts.append(f"eta {duration(s.eta_s)}")
    return " | ".join(parts)


def library_bars(enabled: bool) -> None:
    """transformers' and huggingface_hub's tqdm bars (from_pretrained's "Loading weights", a
    download) on or off for this process. Off in a log: a bar redrawn per tensor becomes hundreds
    of lines there; shardwise's own phase lines say what is loading instead."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()


def _bar(name: str, *columns: Any, stream: TextIO | None) -> Any:
    """A rich Progress: name, a 16-cell bar, `columns`, then the info text, which takes the rest
    of the width and wraps onto more lines rather than squeezing the counts or being cut."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn
    from rich.table import Column

    return Progress(TextColumn(f"[bold]{name}"), BarColumn(bar_width=16), *columns,
                    TextColumn("{task.fields[info]}", table_column=Column(ratio=1, overflow="fold")),
                    console=Console(file=stream), expand=True)


class TrainProgress:
    """The training run's progress: a rich bar (`bar`), plain lines (`lines`) or nothing (`off`).
    `update` is called with the newest step of every logging flush; ETA from the wall clock
    between the first update and now (evaluations and checkpoints included), or from the step
    time before there are two updates."""

    def __init__(self, mode: Mode, total: int, start_step: int = 0, *, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.mode, self.total, self.start_step = mode, total, start_step
        self.stream, self.clock, self.wall = stream, clock, wall
        self.first: tuple[float, int] | None = None  # (clock, step) of the first update
        self.bar: Any = None
        if mode == "bar":
            from rich.progress import MofNCompleteColumn, TimeRemainingColumn

            self.bar = _bar("train", MofNCompleteColumn(), TimeRemainingColumn(), stream=stream)
            self.task = self.bar.add_task("train", total=total, completed=start_step, info="")
            self.bar.start()

    def eta(self, step: int, step_time_s: float) -> float:
        now = self.clock()
        if self.first is None:
            self.first = (now, step)
        t1, s1 = self.first
        per_step = (now - t1) / (step - s1) if step > s1 else step_time_s
        return per_step * max(0, self.total - step)

    def update(self, line: StepLine) -> None:
        if self.mode == "off":
            return
        if self.mode == "bar":
            self.bar.update(self.task, completed=line.step, info=" | ".join(step_fields(line)))
            return
        say(format_step(line), self.stream, self.wall())

    def note(self, text: str) -> None:
        """A one-off event (an evaluation, a skipped step): above the bar, or its own line."""
        if self.mode == "bar":
            self.bar.console.print(text, highlight=False, markup=False, soft_wrap=True)
        elif self.mode == "lines":
            say(text, self.stream, self.wall())
        else:
            print(f"shardwise: {text}", file=sys.stdout if self.stream is None else self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


class PointsProgress:
    """`shardwise bench`'s points: a bar over the points, or a line as each starts and ends."""

    def __init__(self, mode: Mode, total: int, *, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.mode, self.total, self.stream, self.clock = mode, total, stream, clock
        self.n, self.t = 0, clock()
        self.bar: Any = None
        if mode == "bar":
            from rich.progress import MofNCompleteColumn, TimeElapsedColumn

            self.bar = _bar("bench", MofNCompleteColumn(), TimeElapsedColumn(), stream=stream)
            self.task = self.bar.add_task("bench", total=total, info="")
            self.bar.start()

    def started(self, label: str, detail: str = "") -> None:
        self.n, self.t = self.n + 1, self.clock()
        if self.mode == "bar":
            self.bar.update(self.task, info=label)
        elif self.mode == "lines":
            say(f"bench point {self.n}/{self.total} {label}: running" + (f" ({detail})" if detail else ""),
                self.stream)

    def finished(self, label: str, ok: bool = True) -> None:
        if self.mode == "bar":
            if ok:
                self.bar.advance(self.task)
        elif self.mode == "lines":
            say(f"bench point {self.n}/{self.total} {label}: {'done' if ok else 'failed'} in "
                f"{duration(self.clock() - self.t)}", self.stream)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def summary_block(title: str, rows: Sequence[tuple[str, str]], mode: Mode | None = None,
                  stream: TextIO | None = None) -> None:
    """The end-of-run block: a rich table on a terminal (`bar`), else a title line and one
    `  key: value` line per row, never wrapped or cut. `mode` None: by the stream."""
    mode = resolve_mode("auto", stream) if mode is None else mode
    out = sys.stdout if stream is None else stream
    if mode == "bar":
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title, show_header=False)
        for k, v in rows:
            t.add_row(k, v)
        Console(file=stream).print(t)
        return
    width = max((len(k) for k, _ in rows), default=0)
    print(f"{stamp()} {title}", file=out)
    for k, v in rows:
        print(f"  {k + ':':<{width + 1}} {v}", file=out)
    out.flush()
