"""How every shardwise command prints `--help`: click's plain formatter, not typer's rich panel.

Typer's rich panel sizes its columns to the terminal and cuts what does not fit, flag names
included (`--lora-modules-to…` at 80 columns, worse in a pipe), and shows every boolean flag
with a `<bool>` value it does not take. Click's formatter never cuts a name: a name wider than
its column puts the help on the next line, and only the help text is wrapped (to the terminal
width, COLUMNS when piped, at most 120 columns so prose stays readable). Flags show as flags
(`--force`, `--packing / --no-packing`). Every `typer.Typer(...)` of the project passes
`**HELP`; tests/cli/test_help_and_tables.py checks every command at 80 columns.
"""

from __future__ import annotations

from typing import Any

HELP: dict[str, Any] = {"rich_markup_mode": None, "context_settings": {"max_content_width": 120}}


def whole_short_help(app: Any) -> None:
    """The command list (`shardwise --help`) shows each command's first paragraph whole, wrapped,
    instead of click's default of cutting it to fit one line ("every...")."""
    import inspect

    for info in app.registered_commands:
        if info.short_help is None:
            text = info.help or inspect.getdoc(info.callback) or ""
            info.short_help = " ".join(text.split("\n\n")[0].split())
