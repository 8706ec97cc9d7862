"""How `shardwise explain` prints: its Markdown text wrapped to the console's width when piped
(rich's Markdown on a terminal), the Markdown source, the comparison as CSV, or JSON."""

from __future__ import annotations

import csv
import io
import textwrap

from shardwise import strict_json
from shardwise.cli.render import table_width, yes_no

# the comparison's columns (plan/explain.py compare), as CSV
EXPLAIN_KEYS = ("name", "model_states_gb", "total_gb", "fits", "ideal_comm_gb", "engine_comm_gb", "step_s",
                "tokens_per_s_per_gpu", "exposed")


def explain_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    keys = EXPLAIN_KEYS
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(keys)
    for r in rows:
        w.writerow([yes_no(r[k]) if k == "fits" else f"{r[k]:.6g}" if isinstance(r[k], float) else r[k] for k in keys])
    return buf.getvalue()


def wrap_markdown(text: str, width: int, console=None) -> str:
    """Markdown text for a reader, not a renderer: paragraphs and list items wrapped to `width`
    (hanging indent), tables as aligned columns that fit (rich), headings kept."""
    from rich.console import Console

    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("|"):
            block = []
            while i < len(lines) and lines[i].startswith("|"):
                block.append(lines[i])
                i += 1
            out.extend(_md_block_as_table(block, width, console or Console(width=width, highlight=False)))
            continue
        stripped = line.lstrip()
        bullet = ""
        for mark in ("- ", "* "):
            if stripped.startswith(mark):
                bullet = mark
        if not bullet and stripped[:1].isdigit() and ". " in stripped[:5]:
            bullet = stripped[: stripped.index(". ") + 2]
        indent = " " * (len(line) - len(stripped))
        out.extend(textwrap.wrap(line, width, subsequent_indent=indent + " " * len(bullet), break_on_hyphens=False,
                                 break_long_words=False) or [""])
        i += 1
    return "\n".join(out)


def _md_block_as_table(block: list[str], width: int, console) -> list[str]:
    """A Markdown table for a reader at `width`: as written when it fits; else aligned columns
    whose headers wrap but whose values never do; else stacked, one wrapped line per row."""
    from rich import box
    from rich.table import Table

    def cells(row: str) -> list[str]:
        return [c.strip() for c in row.strip().strip("|").split("|")]

    if max(len(b) for b in block) <= width:
        return block
    header, *body = block
    heads = cells(header)
    rows = [cells(b) for b in body if set(b.replace("|", "").strip()) - set("-: ")]
    # a column as wide as its widest value and its header's longest word: neither is cut
    widest = [max([len(r[j]) for r in rows if j < len(r)] + [len(w) for w in h.split()]) for j, h in enumerate(heads)]
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    for j, h in enumerate(heads):
        t.add_column(h, justify="left" if j == 0 else "right", min_width=widest[j], max_width=widest[j])
    for r in rows:
        t.add_row(*r)
    if table_width(console, t) <= width:
        cap = console.__class__(width=width, file=io.StringIO(), highlight=False, color_system=None)
        cap.print(t)
        return [ln.rstrip() for ln in cap.file.getvalue().split("\n") if ln.strip()]
    out = []
    for r in rows:
        text = f"- {r[0]}: " + ", ".join(f"{h} {v}" for h, v in zip(heads[1:], r[1:], strict=False))
        out += textwrap.wrap(text, width, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False)
    return out


def print_explain(text: str, rows: list[dict], fmt: str) -> None:
    """`shardwise explain` in `fmt`: the text (rich Markdown on a terminal, wrapped to the width
    when piped), the Markdown source, the comparison as CSV, or both as JSON."""
    import sys

    if fmt == "json":
        sys.stdout.write(strict_json.dumps({"strategies": rows, "text": text}, indent=2) + "\n")
    elif fmt == "csv":
        sys.stdout.write(explain_csv(rows))
    elif fmt == "markdown":
        sys.stdout.write(text + "\n")
    else:
        from rich.console import Console

        console = Console(highlight=False)
        if console.is_terminal:
            from rich.markdown import Markdown

            console.print(Markdown(text))
        else:
            sys.stdout.write(wrap_markdown(text, console.width) + "\n")
