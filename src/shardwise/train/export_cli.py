"""`shardwise export CHECKPOINT OUT`: a Hugging Face model directory from any checkpoint.

CHECKPOINT is a `step-N` directory or a run's output dir (its newest complete checkpoint).
One process, no process group: the checkpoint's world size and engine do not matter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from shardwise.cli_help import HELP
from shardwise.errors import ExitCode, NonFiniteError, ShardwiseError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  help="Export a shardwise checkpoint as a Hugging Face model directory.", **HELP)  # fmt: skip


@app.command("export")
def export_cmd(
    checkpoint: Annotated[Path, typer.Argument(help="checkpoints/step-N, or a run's output dir (its latest).")],
    out: Annotated[Path, typer.Argument(help="Directory to write (safetensors, config.json, tokenizer).")],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it already has files.")] = False,
    merged: Annotated[bool, typer.Option("--merged", help="LoRA checkpoints: write the base with the adapters "
                                         "merged in (safetensors) instead of the PEFT adapter.")] = False,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Export setting over the run's: export.dtype=auto|bf16|fp16|fp32, "
        "export.max_shard_size=5GB (repeatable).")] = None,
) -> None:
    """Write the checkpoint's weights in the run's compute dtype (export.dtype), sharded at
    export.max_shard_size, with the model config and tokenizer, loadable by
    `AutoModelForCausalLM.from_pretrained(OUT)`. A LoRA checkpoint writes the PEFT adapter
    (`peft.PeftModel.from_pretrained(base, OUT)`), or with --merged the merged model.
    Written beside OUT and renamed when complete."""
    from rich.console import Console

    from shardwise import quiet
    from shardwise.console import library_bars, resolve_mode
    from shardwise.train.checkpoint import resolve_resume
    from shardwise.train.export import export_checkpoint

    quiet.apply()
    library_bars(resolve_mode("auto") == "bar")  # from_pretrained's bar: on a terminal only
    try:
        if out.exists() and not out.is_dir():
            raise ShardwiseError(f"OUT {str(out)!r} is a file, not a directory")
        if out.is_dir() and any(out.iterdir()) and not overwrite:
            raise ShardwiseError(f"OUT {str(out)!r} already has files; pass --overwrite to replace it")
        path = resolve_resume(str(checkpoint), checkpoint)
        assert path is not None  # an explicit path resolves or raises
        written = export_checkpoint(path, out, merged=merged, overrides=tuple(set_ or ()))
    except NonFiniteError as e:
        Console(stderr=True).print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.NONFINITE) from None
    except (ShardwiseError, OSError, ValueError) as e:
        Console(stderr=True).print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.USER_ERROR) from None
    Console().print(f"exported {path} -> {written}")


def main() -> None:
    from shardwise.train.launch import run_cli

    run_cli(app)


if __name__ == "__main__":
    main()
