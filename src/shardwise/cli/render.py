"""How `shardwise plan` and `shardwise explain` print: `--format table|markdown|csv|json`.

One set of rows per plan (`plan_rows`: every number of the memory and time tables, unrounded)
feeds every format, so the table, the Markdown, the CSV and the JSON carry the same numbers.
The table fits the console: rich's width (the terminal's; COLUMNS when piped, 80 without it).
Where the full memory table (21 columns) is wider, it groups the parts (model states,
activations, buffers) and then leaves out the columns it can least spare, saying which; the
numbers in a cell are never wrapped. The plan itself (plan/) stays pure; this module prints.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise import strict_json
from shardwise.numfmt import rate
from shardwise.specs.hardware import GIB

FORMATS = ("table", "markdown", "csv", "json")


def check_format(fmt: str, as_json: bool) -> str:
    """The format a `--format` / `--json` pair asks for (--json is --format json)."""
    from shardwise.errors import ShardwiseError

    fmt = fmt.strip().lower()
    if fmt not in FORMATS:
        raise ShardwiseError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if as_json and fmt not in ("table", "json"):
        raise ShardwiseError(f"--json is --format json; it cannot be given with --format {fmt}")
    return "json" if as_json else fmt


# ----------------------------------------------------------------------------- columns


@dataclass(frozen=True)
class Col:
    key: str
    header: str
    fmt: Callable[[Any], str]
    keep: int = 0  # when the table is too wide, the lowest `keep` goes first
    left: bool = False


def _gib(v: float) -> str:
    return f"{v:.2f}"


def _minus(v: float) -> str:
    """A part subtracted (≤ 0), never shown as -0.00."""
    text = f"{v:.2f}"
    return "0.00" if text == "-0.00" else text


def _host(v: float) -> str:
    return f"{v:.1f}" if v else "-"


def _s(v: float) -> str:
    return f"{v:.2f}"


def _gb(v: float) -> str:
    return f"{v:.1f}"


def yes_no(v: bool) -> str:
    return "yes" if v else "no"


# the memory table: GiB per GPU (host: GiB per node)
MEMORY_COLS = (
    Col("strategy", "strategy", str, 99, left=True),
    Col("params_gib", "params", _gib, 6), Col("grads_gib", "grads", _gib, 6),
    Col("held_gib", "held", _gib, 6),
    Col("master_gib", "master", _gib, 5), Col("optim_gib", "optim", _gib, 6),
    Col("step_gib", "step", _gib, 3), Col("activ_gib", "activ", _gib, 7),
    Col("recomp_gib", "recomp", _gib, 2), Col("logits_gib", "logits", _gib, 4),
    Col("ref_gib", "ref", _gib, 5), Col("ref_fwd_gib", "ref fwd", _gib, 3),
    Col("gathered_gib", "gathered", _gib, 3),
    Col("buffers_gib", "buffers", _gib, 2), Col("grad_buf_gib", "grad buf", _gib, 2),
    Col("overhead_gib", "overhead", _gib, 3), Col("apart_gib", "apart", _minus, 61),
    Col("total_gib", "total", _gib, 98), Col("need_gib", "need", _gib, 90),
    Col("host_gib", "host", _host, 50), Col("fits", "fits", yes_no, 97),
)  # fmt: skip
# the same, its parts grouped (a narrower terminal)
GROUPED_COLS = (
    MEMORY_COLS[0],
    Col("states_gib", "states", _gib, 60), Col("activ_all_gib", "activ+", _gib, 40),
    Col("buffers_all_gib", "buffers+", _gib, 20),
    *MEMORY_COLS[-5:],
)
TIME_COLS = (
    Col("strategy", "strategy", str, 99, left=True),
    Col("comm_paper_gb", "comm paper", _gb, 3), Col("comm_engine_gb", "comm engine", _gb, 10),
    Col("compute_s", "compute s", _s, 5), Col("exposed_s", "exposed s", _s, 20),
    Col("offload_s", "offload s", _s, 4), Col("step_s", "step s", _s, 80),
    Col("tokens_per_s_per_gpu", "tokens/s/GPU", rate, 90), Col("mfu", "MFU", lambda v: f"{v:.0%}", 70),
)  # fmt: skip
GROUPS = {"states": "params + grads + held + master + optim + ref", "activ+": "activ + recomp + logits + ref fwd",
          "buffers+": "step + gathered + buffers + grad buf + overhead"}  # fmt: skip
CSV_COLS = ("strategy", "tp", "cp", "pp", "checkpointing", *(c.key for c in MEMORY_COLS[1:]), *(c.key for c in TIME_COLS[1:]))


def plan_rows(evals: Sequence[Any]) -> list[dict[str, Any]]:
    """One row per planned strategy: every number the tables show, unrounded (GiB, GB, s)."""
    from shardwise.plan.report import label

    rows = []
    for e in evals:
        p, g, t = e.memory, e.memory.gpu, e.time
        lay = p.layout
        r = {"strategy": label(p) + (f" tp{lay.tp}" if lay.tp > 1 else "") + (f" cp{lay.cp}" if lay.cp > 1 else "")
             + (f" pp{lay.pp}" if lay.pp > 1 else "") + (f" ep{lay.ep}" if lay.ep > 1 else "")
             + (f" etp{lay.expert_tp}" if lay.ep > 1 and lay.tp > 1 else ""),
             "tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "checkpointing": e.train.checkpointing,
             "params_gib": g.params / GIB, "grads_gib": g.grads / GIB, "master_gib": g.master_params / GIB,
             "optim_gib": g.optimizer_states / GIB, "step_gib": g.step_buffers / GIB,
             "activ_gib": g.activations / GIB, "recomp_gib": g.recompute / GIB, "logits_gib": g.logits / GIB,
             "ref_gib": g.ref_params / GIB, "ref_fwd_gib": g.ref_forward / GIB,
             "held_gib": g.held_grads / GIB, "gathered_gib": g.gathered_params / GIB,
             "buffers_gib": g.engine_buffers / GIB, "grad_buf_gib": g.grad_buffers / GIB,
             "overhead_gib": g.runtime_overhead / GIB, "apart_gib": -g.not_at_peak / GIB,
             "total_gib": g.total / GIB, "need_gib": g.required / GIB,
             "host_gib": p.host.peak / GIB, "fits": p.fits,
             "comm_paper_gb": e.ideal.total / 1e9, "comm_engine_gb": e.comm.total / 1e9,
             "compute_s": t.compute_s, "exposed_s": t.exposed_comm_s, "offload_s": t.offload_s, "step_s": t.step_s,
             "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu, "mfu": t.mfu}  # fmt: skip
        r["states_gib"] = (r["params_gib"] + r["grads_gib"] + r["held_gib"] + r["master_gib"] + r["optim_gib"]
                           + r["ref_gib"])
        r["activ_all_gib"] = r["activ_gib"] + r["recomp_gib"] + r["logits_gib"] + r["ref_fwd_gib"]
        r["buffers_all_gib"] = (r["step_gib"] + r["gathered_gib"] + r["buffers_gib"] + r["grad_buf_gib"]
                                + r["overhead_gib"])
        rows.append(r)
    return rows


# ----------------------------------------------------------------------------- fitting tables


def _rich_table(cols: Sequence[Col], rows: list[dict]):
    from rich import box
    from rich.table import Table
    from rich.text import Text

    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    for c in cols:
        t.add_column(c.header, justify="left" if c.left else "right", no_wrap=True)
    for r in rows:
        t.add_row(*(Text(c.fmt(r[c.key]), style=_style(c.key, r)) for c in cols))  # Text: a name is not markup
    return t


def _style(key: str, row: dict) -> str:
    if key == "fits":
        return "green" if row["fits"] else "red"
    return "bold" if key == "total_gib" else ""


def table_width(console, table) -> int:
    from rich.measure import Measurement

    # unclamped: Measurement.get caps the answer at the width it is given
    return Measurement.get(console, console.options.update_width(10_000), table).maximum


def fit_table(console, variants: Sequence[Sequence[Col]], rows: list[dict]):
    """The first column set of `variants` whose table fits the console, else the last with its
    least needed columns left out until it fits. Returns (table, columns left out)."""
    for cols in variants:
        t = _rich_table(cols, rows)
        if table_width(console, t) <= console.width:
            return t, []
    cols = list(variants[-1])
    dropped: list[str] = []
    while len(cols) > 2:
        t = _rich_table(cols, rows)
        if table_width(console, t) <= console.width:
            break
        worst = min(cols, key=lambda c: c.keep)
        cols.remove(worst)
        dropped.append(worst.header)
    return _rich_table(cols, rows), dropped


# ----------------------------------------------------------------------------- the plan


@dataclass
class PlanOutput:
    """Everything `shardwise plan` prints after planning."""

    model: Any
    hw: Any
    train: Any
    evals: list
    accounting: str
    rec: Any = None
    rec_error: str | None = None
    alternatives: tuple = ()
    skipped: dict = field(default_factory=dict)
    profile: Path | None = None
    warnings: list = field(default_factory=list)
    emitted: Any = None  # (evaluation, paths)
    notes: list = field(default_factory=list)
    emit_dir: Path | None = None
    tp: int | None = None
    pp: int | None = None
    hardware: str | None = None  # --hardware: auto or the doctor's spec file (None: the flags)
    source: Any = None  # --from FILE's reading (shardwise.ingest.Source): keys read, ignored, advice


def plan_title(o: PlanOutput) -> list[str]:
    from shardwise.plan.preference import objective_words
    from shardwise.plan.report import links_line, loss_words

    m, hw, train = o.model, o.hw, o.train
    line = (f"{m.name} ({m.params / 1e9:.2f}B params) on {hw.world_size}× {hw.gpu.name} "
            f"({hw.gpu.memory_bytes / GIB:.0f} GiB), seq {train.seq_len} × micro-batch {train.micro_batch}"
            f" × accum {train.grad_accum}, {train.precision}, checkpointing {train.checkpointing}"
            + (f", {'QLoRA (NF4 base)' if train.base_quant == 'nf4' else 'LoRA'} rank {train.lora_rank} on "
               f"{','.join(train.lora_targets)}" if train.lora_rank else "") + f", {loss_words(train)}"
            + (f", {objective_words(train)}" if train.objective != "sft" else ""))
    return [line, links_line(hw)] + ([f"hardware profile: {o.profile}"] if o.profile else [])


MEMORY_CAPTION = ("GiB per GPU; total = peak of the step on the device, as nvidia-smi shows it: the columns before "
                  "it add up to it, apart subtracting the parts not live at the peak (activations and gradients do "
                  "not peak together); held = FSDP2's unsharded grads held between micro-batches; need = what fits is decided on: the allocated peak, allocator "
                  "slack a cache flush cannot return, CUDA context and NCCL (the allocator frees its cache before it "
                  "raises OOM); host = CPU RAM per node at its peak: loading the weights, or offloaded states while "
                  "training")
TIME_TITLE = "Communication and time per optimizer step"
TIME_CAPTION = "comm: GB per GPU (ring volume; paper = ZeRO paper's ideal); exposed = not hidden by compute"


def _notes(o: PlanOutput) -> list[tuple[str, str, list[str]]]:
    """The lines after the tables as (style, head, items)."""
    out: list[tuple[str, str, list[str]]] = []
    if o.skipped:
        out.append(("", f"Not in the table (cannot run with tp {o.tp or 1}, pp {o.pp or 1} here):",
                    ["  - " + (why if repr(name) in why or why.startswith(name) else f"{name}: {why}")
                     for name, why in o.skipped.items()]))
    if o.rec is None:
        out.append(("bold red", f"Nothing fits: {o.rec_error}", []))
    elif o.rec.runnable:
        out.append(("bold green", f"Recommended: {o.rec.reason}", []))
    else:
        out.append(("bold yellow", f"Recommended (plan-only: run it with {o.rec.tool}): {o.rec.reason}", []))
    if o.rec is not None and o.alternatives:
        out.append(("", "Plan-only alternatives (faster, but shardwise train and --emit cannot run them):",
                    [f"  - {a.why}" for a in o.alternatives]))
    if o.emitted:
        from shardwise.plan.recommend import describe

        chosen, paths = o.emitted
        out.append(("", f"Emitted {describe(chosen)} to {o.emit_dir}:",
                    [f"  note: {n}" for n in o.notes] + [f"wrote {p}" for p in paths]))
    return out


def _load(o: PlanOutput) -> list[str]:
    """The host's load-phase line under the memory table (none when nothing loads on the host)."""
    from shardwise.plan.report import load_line

    line = load_line([e.memory for e in o.evals])
    return [line] if line else []


def _grad_sync(o: PlanOutput) -> list[str]:
    """One line per FSDP2 row under accumulation: held unsharded grads or a reduce-scatter per
    micro-batch, and why (shardwise.plan.grad_sync)."""
    from shardwise.plan.report import label

    return [f"Gradient sync: {label(e.memory)}" + e.memory.grad_sync.line().removeprefix(e.memory.strategy.name)
            for e in o.evals if e.memory.grad_sync is not None and e.memory.runs_as is None]


def _recompute(o: PlanOutput) -> list[str]:
    """`checkpointing: auto`'s choice per row, grouped (plan/recompute.py)."""
    from shardwise.plan.recompute import grouped_lines

    return grouped_lines([e.recompute for e in o.evals if e.recompute is not None])


def plan_doc(o: PlanOutput) -> dict:
    """The `--format json` object (docs/plan-json.md)."""
    from shardwise.plan.report import plan_json

    doc = plan_json(o.model, o.hw, o.train, o.evals, o.accounting, o.rec, skipped=o.skipped, profile=o.profile)
    doc["hardware"]["hardware_spec"] = o.hardware
    doc["warnings"] = list(o.warnings)
    if o.source is not None:
        doc["from"] = o.source.as_dict()
    if o.rec is None:
        doc["recommended"], doc["recommended_setting"], doc["runner_up"] = None, None, None
        doc["reason"] = o.rec_error
        doc["plan_only_alternatives"] = [a.as_dict() for a in o.alternatives]
    if o.emitted:
        from shardwise.plan.recommend import schedule_of

        chosen, paths = o.emitted
        lay = chosen.memory.layout
        doc["emitted"] = [str(p) for p in paths]
        doc["emitted_setting"] = {
            "strategy": chosen.strategy.name, "tp": lay.tp, "pp": lay.pp, **schedule_of(chosen), "cp": lay.cp,
            "micro_batch": chosen.train.micro_batch,
            "grad_accum": chosen.train.grad_accum, "checkpointing": chosen.train.checkpointing,
            "tokens_per_s_per_gpu": chosen.time.tokens_per_s_per_gpu, "memory_total": chosen.memory.gpu.total,
            "notes": list(o.notes)}  # fmt: skip
    return doc


def plan_csv(o: PlanOutput) -> str:
    """One row per strategy, every column of both tables (GiB, GB, s; fits as yes/no; MFU a fraction)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLS)
    for r in plan_rows(o.evals):
        w.writerow([yes_no(r[k]) if k == "fits" else f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]
                    for k in CSV_COLS])
    return buf.getvalue()


def _md_table(cols: Sequence[Col], rows: list[dict]) -> list[str]:
    def cell(s: str) -> str:
        return s.replace("|", "\\|")

    out = ["| " + " | ".join(c.header for c in cols) + " |",
           "|" + "|".join(":---" if c.left else "---:" for c in cols) + "|"]
    out += ["| " + " | ".join(cell(c.fmt(r[c.key])) for c in cols) + " |" for r in rows]
    return out


def plan_markdown(o: PlanOutput) -> str:
    rows = plan_rows(o.evals)
    title = plan_title(o)
    out = [f"## {title[0]}", "", *(f"{t}  " for t in title[1:]), "", *_md_table(MEMORY_COLS, rows), "",
           MEMORY_CAPTION, "", *_load(o), "", *(f"{x}  " for x in _recompute(o) + _grad_sync(o)), "", f"### {TIME_TITLE}", "", *_md_table(TIME_COLS, rows), "", TIME_CAPTION, ""]
    for style, head, items in _notes(o):
        label, _, rest = head.partition(": ")
        out.append(f"**{label}:** {rest}" if style else head)
        out += [f"- {i.strip().removeprefix('- ')}" for i in items]
        out.append("")
    if o.source is not None:  # --from FILE: its reading and what to change in it, as printed
        from rich.console import Console

        from shardwise.ingest.advice import print_source

        buf = io.StringIO()
        print_source(Console(file=buf, width=10**4, color_system=None, highlight=False), o.source)
        out += [f"### From {o.source.path.name}", "", "```", buf.getvalue().rstrip("\n"), "```", ""]
    return "\n".join(out)


def print_plan(o: PlanOutput, fmt: str, console=None) -> None:
    """Print the plan in `fmt` (FORMATS) on stdout (warnings went to stderr before)."""
    import sys

    if fmt == "json":
        sys.stdout.write(strict_json.dumps(plan_doc(o), indent=2) + "\n")
        return
    if fmt == "csv":
        sys.stdout.write(plan_csv(o))
        return
    if fmt == "markdown":
        sys.stdout.write(plan_markdown(o))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.text import Text

    console = console or Console(highlight=False)
    rows = plan_rows(o.evals)
    for line in plan_title(o):
        console.print(Text(line, style="italic"))
    mem, dropped = fit_table(console, (MEMORY_COLS, GROUPED_COLS), rows)
    console.print(mem)
    grouped = [h for h in GROUPS if h in [c.header for c in mem.columns]]
    caption = MEMORY_CAPTION + "".join(f"; {h} = {GROUPS[h]}" for h in grouped)
    console.print(Text(caption + _left_out(dropped), style="dim"))
    for line in _load(o) + _recompute(o) + _grad_sync(o):
        console.print(Text(line))
    console.print()
    console.print(Text(TIME_TITLE, style="italic"))
    tt, dropped = fit_table(console, (TIME_COLS,), rows)
    console.print(tt)
    console.print(Text(TIME_CAPTION + _left_out(dropped), style="dim"))
    for style, head, items in _notes(o):
        if style:
            label, _, rest = head.partition(": ")
            console.print(f"[{style}]{escape(label)}:[/] {escape(rest)}")
        else:
            console.print(escape(head))
        for i in items:
            # a written path stays whole on its line (copyable), everything else wraps
            console.print(escape(i), soft_wrap=i.startswith("wrote "))
    if o.source is not None:  # --from FILE: the keys read and ignored, and what to change in it
        from shardwise.ingest.advice import print_source

        print_source(console, o.source)


def _left_out(dropped: list[str]) -> str:
    if not dropped:
        return ""
    return (f". Left out at this width: {', '.join(dropped)} (a wider terminal, COLUMNS=160, or --format "
            "markdown/csv/json shows every column)")
