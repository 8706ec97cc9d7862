"""How `shardwise plan --device cpu` prints: host memory per rank and per node of each strategy
(shardwise.plan.host_cpu), in the formats of `shardwise plan` (table, markdown, csv, json)."""

from __future__ import annotations

import csv
import io
import sys
from dataclasses import dataclass
from typing import Any

from shardwise import strict_json
from shardwise.specs.hardware import GIB

COLUMNS = (("strategy", "strategy"), ("process", "process"), ("allocated", "tensors"), ("heap_slack", "heap"),
           ("training", "training"), ("load", "load"), ("peak", "peak"), ("per_node", "node"), ("fits", "fits"))
CAPTION = ("GiB of host memory (resident set) per rank: process = the interpreter and its libraries "
           "(measured per engine), tensors = the step's allocated peak (what a GPU plan books: model states, "
           "gathered parameters, activations, the step's buffers), heap = freed blocks glibc keeps, training = "
           "their sum, load = the peak while the weights load, peak = the larger; node = every rank of the node "
           "at its peak and the launcher (docs/training.md \"Host memory of CPU runs\")")


@dataclass(frozen=True)
class CpuPlan:
    """Everything `plan --device cpu` prints."""

    title: str
    rows: list[dict[str, Any]]  # per strategy: name, CpuRankMemory.as_dict(), fits
    available: float
    available_source: str
    notes: list[str]
    source: Any = None  # --from FILE's reading (shardwise.ingest.Source)


def cpu_rows(evals: list, loads: dict, available: float) -> list[dict[str, Any]]:
    """One row per planned strategy: `loads` maps a strategy's name to its CpuRankMemory."""
    rows = []
    for e in evals:
        mem = loads[e.strategy.name]
        d = mem.as_dict()
        rows.append({"strategy": e.strategy.name, **{k: d[k] for k in ("process", "allocated", "heap_slack",
                                                                        "training", "peak", "per_node", "phase")},
                     "load": mem.load.per_rank, "load_path": mem.load.path, "fits": mem.per_node <= available,
                     "terms": d})
    return rows


def _cell(key: str, v: Any) -> str:
    if key == "fits":
        return "yes" if v else "no"
    return v if isinstance(v, str) else f"{v / GIB:.2f}"


def print_cpu_plan(p: CpuPlan, fmt: str) -> None:
    if fmt == "json":
        doc = {"device": "cpu", "title": p.title, "host_available_bytes": p.available,
               "host_available_source": p.available_source, "notes": p.notes,
               "strategies": [{"name": r["strategy"], "fits": r["fits"], "host": r["terms"]} for r in p.rows]}
        if p.source is not None:
            doc["from"] = p.source.as_dict()
        sys.stdout.write(strict_json.dumps(doc, indent=2) + "\n")
        return
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow([k for k, _ in COLUMNS])
        for r in p.rows:
            w.writerow([_cell("fits", r["fits"]) if k == "fits" else r[k] if k == "strategy" else f"{r[k]:.6g}"
                        for k, _ in COLUMNS])
        sys.stdout.write(buf.getvalue())
        return
    where = f"the node has {p.available / GIB:.2f} GiB ({p.available_source})"
    if fmt == "markdown":
        out = [p.title, "", "| " + " | ".join(h for _, h in COLUMNS) + " |",
               "|" + "|".join(":---" if k == "strategy" else "---:" for k, _ in COLUMNS) + "|"]
        out += ["| " + " | ".join(_cell(k, r[k]) for k, _ in COLUMNS) + " |" for r in p.rows]
        out += ["", CAPTION + "; " + where + ".", *[f"- {n}" for n in p.notes]]
        sys.stdout.write("\n".join(out) + "\n")
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    console.print(Text(p.title, style="italic"))
    table = Table(box=None, header_style="bold")
    for k, h in COLUMNS:
        table.add_column(h, justify="left" if k == "strategy" else "right", no_wrap=True)
    for r in p.rows:
        table.add_row(*(_cell(k, r[k]) for k, _ in COLUMNS), style="" if r["fits"] else "red")
    console.print(table)
    console.print(Text(CAPTION + "; " + where, style="dim"))
    for n in p.notes:
        console.print(Text(n))
    if p.source is not None:  # --from FILE: the keys read and ignored
        from shardwise.ingest.advice import print_source

        print_source(console, p.source)
