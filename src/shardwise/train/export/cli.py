"""`shardwise export CHECKPOINT OUT`: a Hugging Face model directory from any checkpoint.

CHECKPOINT is a `step-N` directory or a run's output dir (its newest complete checkpoint).
One process, no process group: the checkpoint's world size and engine do not matter.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from shardwise.cli_help import HELP
from shardwise.errors import ExitCode, NonFiniteError, OutOfSpaceError, ShardwiseError

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
    trust_remote_code: Annotated[bool, typer.Option(
        "--trust-remote-code", help="LoRA checkpoints of a base model that ships its own Python code "
        "(auto_map): run that code to rebuild the base. Never taken from the checkpoint.")] = False,
) -> None:
    """Write the checkpoint's weights in the run's compute dtype (export.dtype), sharded at
    export.max_shard_size, with the model config and tokenizer, loadable by
    `AutoModelForCausalLM.from_pretrained(OUT)`. A LoRA checkpoint writes the PEFT adapter
    (`peft.PeftModel.from_pretrained(base, OUT)`), or with --merged the merged model.
    Written beside OUT and renamed when complete."""
    from rich.console import Console

    from shardwise import quiet
    from shardwise.console import library_bars, resolve_mode
    from shardwise.train.checkpoint.sharded import resolve_resume
    from shardwise.train.export.hf_dir import export_checkpoint

    quiet.apply()
    library_bars(resolve_mode("auto") == "bar")  # from_pretrained's bar: on a terminal only
    try:
        if out.exists() and not out.is_dir():
            raise ShardwiseError(f"OUT {str(out)!r} is a file, not a directory")
        if out.is_dir() and any(out.iterdir()) and not overwrite:
            raise ShardwiseError(f"OUT {str(out)!r} already has files; pass --overwrite to replace it")
        path = resolve_resume(str(checkpoint), checkpoint)
        assert path is not None  # an explicit path resolves or raises
        check_replaceable(out, checkpoint, path)
        written = export_checkpoint(path, out, merged=merged, overrides=tuple(set_ or ()),
                                    trust_remote_code=trust_remote_code)
    except NonFiniteError as e:
        Console(stderr=True).print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.NONFINITE) from None
    except OutOfSpaceError as e:  # nothing was published: the temp directory is removed, OUT is as it was
        Console(stderr=True).print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.NO_SPACE) from None
    except (ShardwiseError, OSError, ValueError) as e:
        Console(stderr=True).print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.USER_ERROR) from None
    Console().print(f"exported {path} -> {written}")


# What only a training run writes: an OUT holding any of these is a run (or checkpoints), never an export.
RUN_MARKERS = ("manifest.json", "checkpoints", ".shardwise", ".shardwise.lock", "trainer_state.json",
               "metrics.jsonl", "summary.json", ".metadata")


def check_replaceable(out: Path, given: Path, checkpoint: Path) -> None:
    """`--overwrite` replaces an earlier export, never what is being exported or a training run:
    OUT may not be, hold or lie inside the checkpoint (or the run dir given), may not hold
    anything only a run writes (RUN_MARKERS, at any depth; symlinks are not followed), and, when
    it has files, must look like an export (a config.json or adapter_config.json at its top)."""
    target = out.resolve()
    for src in {given.resolve(), checkpoint.resolve()}:
        if target == src or target in src.parents or src in target.parents:
            raise ShardwiseError(f"OUT {str(out)!r} overlaps the checkpoint being exported ({src}): an export "
                                 "there would replace it; choose a directory outside it")
    if not out.is_dir() or not any(out.iterdir()):
        return
    for root, dirs, files in os.walk(out):  # os.walk does not descend into symlinked directories
        hit = sorted(set(RUN_MARKERS) & {*dirs, *files})
        if hit:
            where = Path(root) / hit[0]
            raise ShardwiseError(f"OUT {str(out)!r} holds {where}, which a training run wrote (a run or its "
                                 "checkpoints, not an earlier export): --overwrite only replaces an export; "
                                 "nothing was changed. Choose another OUT")
    if not any((out / name).is_file() for name in ("config.json", "adapter_config.json")):
        raise ShardwiseError(f"OUT {str(out)!r} has files but no config.json or adapter_config.json: not an "
                             "earlier export, which is all --overwrite replaces; nothing was changed. Choose "
                             "another OUT")


def main() -> None:
    from shardwise.train.launch.rank import run_cli

    run_cli(app)


if __name__ == "__main__":
    main()
