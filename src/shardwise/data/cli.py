"""`shardwise data ...` commands (mounted by the main CLI). Heavy imports stay inside commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from shardwise.cli_help import HELP
from shardwise.errors import ShardwiseError

app = typer.Typer(help="Inspect SFT data the way the trainer will see it.", no_args_is_help=True, **HELP)


@app.callback()
def _group() -> None:
    """SFT data tools."""  # keeps `inspect` a sub-command even though it is the only one


@app.command("inspect")
def inspect_cmd(
    file: Annotated[list[Path], typer.Argument(help="JSON, JSONL or Parquet file(s).")],
    tokenizer: Annotated[Optional[Path], typer.Option(help="Local tokenizer dir (default: bundled).")] = None,  # noqa: UP045
    format: Annotated[str, typer.Option(help="auto, alpaca, chat, sharegpt or text.")] = "auto",
    max_length: Annotated[int, typer.Option(help="Tokens per sample / packed row.")] = 2048,
    truncation: Annotated[str, typer.Option(help="keep_start, cut_prompt, drop or raise.")] = "keep_start",
    train_on_prompt: Annotated[bool, typer.Option(help="Learn prompt tokens too.")] = False,
    packing: Annotated[bool, typer.Option(help="Pack samples into rows.")] = True,
    on_error: Annotated[str, typer.Option(help="raise or skip (counted) invalid records.")] = "raise",
    field: Annotated[Optional[list[str]], typer.Option(help="Rename: canonical=column, repeatable.")] = None,  # noqa: UP045
    sample: Annotated[int, typer.Option(help="Index of the sample to render.")] = 0,
    plain: Annotated[Optional[bool], typer.Option(  # noqa: UP045
        "--plain/--color", help="Learned tokens wrapped in ⟦ ⟧ (the default when stdout is not a terminal, "
        "e.g. piped or in a batch log, or NO_COLOR is set) or marked by colour.")] = None,
    trust_remote_code: Annotated[bool, typer.Option(
        help="Run Python code the tokenizer directory ships (auto_map), as model.trust_remote_code does "
             "for training. Off: such a tokenizer is refused.")] = False,
) -> None:
    """Statistics (samples, tokens, targets, lengths, truncation, packing) and one rendered sample."""
    if plain is None:  # colour is lost in a pipe or a log: mark learned tokens in the text there
        probe = Console()
        plain = not probe.is_terminal or probe.no_color
    console = Console(no_color=plain, highlight=False, soft_wrap=True)
    try:
        fields = {}
        for item in field or []:
            key, sep, col = item.partition("=")
            if not sep or not key or not col:
                raise ShardwiseError(f"inspect: field '--field': expected canonical=column, got {item!r}.")
            fields[key] = col
        from shardwise.config.data import load_data_config
        from shardwise.data import load_tokenizer
        from shardwise.data.dataset import build_dataset
        from shardwise.data.inspect import report

        cfg = load_data_config(
            {"train_files": [str(f) for f in file], "format": format, "max_length": max_length,
             "truncation": truncation, "train_on_prompt": train_on_prompt, "packing": packing,
             "on_error": on_error, "fields": fields}, source="shardwise data inspect")  # fmt: skip
        tok = load_tokenizer(tokenizer, trust_remote_code=trust_remote_code,
                             opt_in="pass --trust-remote-code (model.trust_remote_code: true in a train config)")
        ds = build_dataset(cfg, tok)
        console.print(report(ds, tok, sample=sample, plain=plain))
    except ShardwiseError as exc:
        from rich.markup import escape

        Console(stderr=True, no_color=plain, soft_wrap=True).print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        raise typer.Exit(2) from exc
