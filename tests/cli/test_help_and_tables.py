"""Help and tables that fit: every flag name whole in `--help` at 80 columns,
flags shown as flags, `plan` and `explain` within the terminal's width when piped (COLUMNS),
and `--format markdown|csv` that parse and carry the numbers of `--format json`."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from shardwise.cli.app import app
from shardwise.config.strategy import STRATEGY_NAMES


def _shardwise(*args: str, columns: int) -> subprocess.CompletedProcess:
    """`shardwise ARGS` with stdout a pipe, as under sbatch / nohup / `| tee`."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TERMINAL_WIDTH")}
    env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "shardwise.cli.app", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def _commands() -> dict[str, tuple[typer.Typer, list[str], object]]:
    """Every command a user can ask --help of: the planner's verbs and the lazily mounted apps
    (their click commands, built from the typer apps as `shardwise NAME` runs them)."""
    from shardwise.bench.bench_cli import app as bench
    from shardwise.bench.calibrate_cli import app as calibrate
    from shardwise.data.cli import app as data
    from shardwise.doctor.cli import app as doctor
    from shardwise.train.cli import app as train
    from shardwise.train.export.cli import app as export

    root = get_command(app)
    out = {f"shardwise {n}": (app, [n], c) for n, c in root.commands.items()
           if n not in ("data", "train", "export", "calibrate", "bench", "doctor")}  # these: their own apps, below
    out["shardwise"] = (app, [], root)
    for name, sub in (("train", train), ("export", export), ("calibrate", calibrate), ("bench", bench),
                      ("doctor", doctor)):
        out[f"shardwise {name}"] = (sub, [], get_command(sub))
    group = get_command(data)
    out["shardwise data"] = (data, [], group)
    for n, c in group.commands.items():
        out[f"shardwise data {n}"] = (data, [n], c)
    return out


def _options(cmd) -> list:
    """The command's options (typer's click: its own classes, so by kind, not isinstance)."""
    return [p for p in cmd.params if p.param_type_name == "option"]


def _flag_names(cmd) -> list[str]:
    return [o for p in _options(cmd) for o in (*p.opts, *p.secondary_opts)]


def test_plan_help_piped_at_80_columns_has_every_flag_name_whole():
    res = _shardwise("plan", "--help", columns=80)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    names = _flag_names(get_command(app).commands["plan"])
    assert len(names) > 50  # derived from the command, not a hand list
    for name in names:
        assert re.search(rf"(^|[\s,/]){re.escape(name)}($|[\s,/])", out, re.M), name
    assert "…" not in out and "<bool>" not in out
    assert max(len(line) for line in out.splitlines()) <= 80


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_command_help_has_its_flag_names_whole_and_flags_as_flags(name):
    typer_app, args, cmd = _commands()[name]
    res = CliRunner().invoke(typer_app, [*args, "--help"], env={"COLUMNS": "80"}, prog_name=name)
    assert res.exit_code == 0, res.output
    out = res.output
    for flag in _flag_names(cmd):
        assert re.search(rf"(^|[\s,/]){re.escape(flag)}($|[\s,/])", out, re.M), (name, flag)
    assert "…" not in out
    # a flag takes no value: no `--force <bool>`
    assert "<bool>" not in out
    options = out[out.index("\nOptions:"):]
    names = [re.split(r"\s{2,}", ln.strip())[0] for ln in options.splitlines() if ln.strip().startswith("-")]
    assert _options(cmd), name  # --help at least
    for p in _options(cmd):
        if p.is_flag:
            shown = next(n for n in names if p.opts[0] in re.split(r"[ ,/]+", n))  # its row of Options
            assert "<" not in shown, (name, shown)  # `--force`, `--packing / --no-packing`


@pytest.mark.parametrize("columns", [100, 80])
def test_default_plan_fits_the_width_when_piped(columns):
    res = _shardwise("plan", columns=columns)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert max(len(line) for line in lines) <= columns, max(lines, key=len)
    assert "…" not in res.stdout  # nothing cut: columns left out are named instead
    first = [line.split()[0] for line in lines if line.split()]
    for strategy in STRATEGY_NAMES:
        assert strategy in first, strategy  # every row, its name whole
    assert "Recommended:" in res.stdout and "tokens/s/GPU" in res.stdout
    if columns < 150:
        assert "Left out at this width" in " ".join(res.stdout.split())


def test_wide_plan_has_every_column():
    out = _shardwise("plan", "-s", "zero3", columns=200).stdout
    for head in ("params", "grads", "master", "optim", "activ", "recomp", "logits", "grad buf", "overhead",
                 "total", "need", "host", "fits", "comm paper", "comm engine", "exposed s", "MFU"):
        assert head in out, head
    assert "Left out" not in out


@pytest.mark.parametrize("columns", [100, 60])
def test_explain_fits_the_width_when_piped(columns):
    res = _shardwise("explain", columns=columns)
    assert res.returncode == 0, res.stderr
    assert max(len(line) for line in res.stdout.splitlines()) <= columns
    assert "…" not in res.stdout
    for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
        assert re.search(rf"^\W*{strategy}\b", res.stdout, re.M), strategy


def _invoke(*args: str) -> str:
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 0, res.output
    return res.output


PLAN = ("plan", "-s", "zero3", "-s", "fsdp", "-s", "zero2+opt-offload", "--gpus", "16", "--gpus-per-node", "8")
GIB = 2**30


def _by_name(doc: dict) -> dict:
    return {s["name"]: s for s in doc["strategies"]}


def test_plan_csv_parses_and_carries_the_json_numbers():
    doc = _by_name(json.loads(_invoke(*PLAN, "--format", "json")))
    rows = list(csv.DictReader(io.StringIO(_invoke(*PLAN, "--format", "csv"))))
    assert [r["strategy"] for r in rows] == list(doc)
    for r in rows:
        s = doc[r["strategy"]]
        mem, t = s["memory"], s["time"]
        for col, want in (("total_gib", mem["total"] / GIB), ("need_gib", mem["required"] / GIB),
                          ("params_gib", mem["params"] / GIB), ("optim_gib", mem["optimizer_states"] / GIB),
                          ("activ_gib", mem["activations"] / GIB), ("host_gib", s["host_memory"]["peak"] / GIB),
                          ("comm_engine_gb", s["comm"]["total"] / 1e9), ("step_s", t["step_s"]),
                          ("tokens_per_s_per_gpu", t["tokens_per_s_per_gpu"]), ("mfu", t["mfu"])):
            assert float(r[col]) == pytest.approx(want, rel=1e-5, abs=1e-9), (r["strategy"], col)
        assert r["fits"] == ("yes" if s["fits"] else "no")
        assert int(r["tp"]) == s["tp"] and int(r["pp"]) == s["pp"] and r["checkpointing"] == s["checkpointing"]


def _md_tables(text: str) -> list[list[list[str]]]:
    tables, cur = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cur.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif cur:
            tables.append(cur)
            cur = []
    return tables


def test_plan_markdown_tables_are_well_formed_and_carry_the_json_numbers():
    doc = _by_name(json.loads(_invoke(*PLAN, "--json")))
    md = _invoke(*PLAN, "--format", "markdown")
    tables = _md_tables(md)
    assert len(tables) == 2  # memory, then communication and time
    for t in tables:
        assert len({len(row) for row in t}) == 1  # every row as many cells as the header
        assert all(re.fullmatch(r":?-+:?", c) for c in t[1])  # the delimiter row
        assert [row[0] for row in t[2:]] == list(doc)
    mem, tm = ({row[0]: dict(zip(t[0], row, strict=True)) for row in t[2:]} for t in tables)
    for name, s in doc.items():
        assert float(mem[name]["total"]) == pytest.approx(s["memory"]["total"] / GIB, abs=0.005)
        assert float(mem[name]["need"]) == pytest.approx(s["memory"]["required"] / GIB, abs=0.005)
        assert float(mem[name]["grads"]) == pytest.approx(s["memory"]["grads"] / GIB, abs=0.005)
        assert mem[name]["fits"] == ("yes" if s["fits"] else "no")
        assert float(tm[name]["step s"]) == pytest.approx(s["time"]["step_s"], abs=0.005)
        assert float(tm[name]["tokens/s/GPU"].replace(",", "")) == pytest.approx(
            s["time"]["tokens_per_s_per_gpu"], abs=0.5)
        assert float(tm[name]["MFU"].rstrip("%")) == pytest.approx(100 * s["time"]["mfu"], abs=0.5)
    assert "**Recommended:**" in md


def test_json_flag_is_format_json_and_conflicts_are_refused():
    assert json.loads(_invoke("plan", "-s", "zero3", "--json")) == json.loads(
        _invoke("plan", "-s", "zero3", "--format", "json"))
    for args in (["--format", "yaml"], ["--json", "--format", "csv"]):
        res = CliRunner().invoke(app, ["plan", *args])
        assert res.exit_code == 2 and "--format" in res.output, res.output


def test_explain_csv_and_json_carry_the_same_numbers():
    rows = list(csv.DictReader(io.StringIO(_invoke("explain", "--format", "csv"))))
    doc = json.loads(_invoke("explain", "--json"))
    assert [r["name"] for r in rows] == [s["name"] for s in doc["strategies"]] == ["ddp", "zero1", "zero2", "zero3",
                                                                                    "fsdp"]
    for r, s in zip(rows, doc["strategies"], strict=True):
        for col in ("total_gb", "engine_comm_gb", "step_s", "tokens_per_s_per_gpu"):
            assert float(r[col]) == pytest.approx(s[col], rel=1e-5)
    md = _invoke("explain", "--format", "markdown")
    assert md.strip() == doc["text"].strip()
    (table,) = _md_tables(md)
    assert len({len(row) for row in table}) == 1


def test_the_command_list_shows_each_summary_whole():
    out = " ".join(_shardwise("--help", columns=80).stdout.split())
    for name, cmd in get_command(app).commands.items():
        first = " ".join((cmd.help or "").split("\n\n")[0].split())
        assert f"{name} {first}" in out, name
    assert "..." not in out.partition("Commands:")[2]  # click's default cut each to one line: "every..."
