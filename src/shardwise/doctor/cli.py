"""`shardwise doctor` (docs/doctor.md): the command; the work is shardwise.doctor's. Torch-free."""

from __future__ import annotations

from pathlib import Path

import typer

from shardwise import strict_json
from shardwise.cli_help import HELP
from shardwise.errors import ShardwiseError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, **HELP)


def _fail(err: Exception) -> None:
    """As the other verbs: `error: ...` on stderr, exit 2."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(f"[red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


@app.command()
def doctor(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (the hardware spec, readings, "
                                 "warnings)."),
    write: Path | None = typer.Option(None, "--write", help="Write the hardware spec here (YAML) for plan "
                                      "--hardware FILE and the trainer's hardware.machine."),
    setup: list[Path] | None = typer.Option(None, "--setup", help="A training setup to check for known silent "
                                            "failures: DeepSpeed JSON, accelerate YAML, shardwise/LLaMA-Factory/"
                                            "axolotl YAML (repeatable)."),
    strategy: str | None = typer.Option(None, "--strategy", "-s", help="The planned strategy (as in plan -s)."),
    qlora: bool = typer.Option(False, "--qlora", help="The plan's base is 4-bit (bitsandbytes)."),
    quant_storage: str | None = typer.Option(None, "--quant-storage", help="bnb_4bit_quant_storage of that base "
                                             "(bitsandbytes' default: uint8)."),
    disk: Path = typer.Option(Path("."), "--disk", help="Where checkpoints go: the filesystem whose free space "
                              "is read."),
) -> None:
    """Read this machine (GPUs, topology, InfiniBand/RoCE, NCCL settings, host, versions), name what will
    hurt, and write the hardware spec plan --hardware uses. Exit 1 when something is an error."""
    import yaml

    from shardwise.doctor import SystemReader, diagnose
    from shardwise.doctor.setup import from_flags, read_setup

    try:
        setups = [read_setup(p) for p in setup or ()]
        flagged = from_flags(strategy, qlora, quant_storage)
        setups += [flagged] if flagged else []
        reports = [diagnose(SystemReader(), s, disk_path=str(disk)) for s in setups] or [
            diagnose(SystemReader(), None, disk_path=str(disk))]
        if write is not None:
            try:
                write.write_text(yaml.safe_dump(reports[0].hardware.model_dump(mode="json"), sort_keys=False))
            except OSError as e:
                raise ShardwiseError(f"--write {write}: cannot write the hardware spec ({e.strerror})") from None
    except ShardwiseError as e:
        _fail(e)
    first = reports[0]
    if as_json:
        doc = first.as_dict()
        if len(reports) > 1:
            doc["setups"] = [{"setup": r.as_dict()["setup"], "silent_failures": r.as_dict()["silent_failures"]}
                             for r in reports]
        typer.echo(strict_json.dumps(doc, indent=2))
    else:
        typer.echo(first.text())
        for r in reports[1:]:
            typer.echo("\n".join(r.text().splitlines()[-1 - len(r.setup_findings):]))
        if write is not None:
            typer.echo(f"wrote {write}")
    if any(r.worst == "error" for r in reports):
        raise typer.Exit(1)
