"""`shardwise bench` output: report.md with its PNG plots (shardwise.bench.bench_plots) and the
rich table printed at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardwise.bench.bench_plots import (
    MIB,
    comm_total_error,
    plot_errors,
    plot_memory,
    plot_states,
    plot_time,
    plot_timeline,
)
from shardwise.numfmt import rate

TIME_TERMS = ("forward", "backward", "optimizer", "exposed_comm", "step")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MIB:,.2f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.2f}"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def comm_bound_lines(p: dict[str, Any]) -> list[str]:
    """The 40% rule's paragraph for one point (empty when the step is not communication-bound)."""
    cb = p.get("comm_bound") or {}
    if not cb.get("bound"):
        return []
    where = "" if p["time"].get("comparable", True) else (
        " (The planner's figures are for the GPU the config plans, not this CPU.)")
    return [f"> **Communication-bound.** {cb['message']}{where}", ""]


def _time_section(p: dict[str, Any]) -> list[str]:
    t = p["time"]
    terms = t["terms"]
    tps = rate(t["tokens_per_s"]) if t["tokens_per_s"] else "-"
    mfu = f"{t['mfu']:.1%}" if t.get("mfu") else "- (no GPU peak on CPU)"
    lines = [f"### Step time (median of steps {t['timed_steps']}; rank 0)", "",
             "| term | predicted ms | measured ms | error |", "|---|---:|---:|---:|"]
    for k in TIME_TERMS:
        v = terms[k]
        lines.append(f"| {k.replace('_', ' ')} | {_ms(v['predicted'])} | {_ms(v['measured'])} | "
                     f"{_pct(v['rel_error'])} |")
    sh = terms["exposed_comm_share"]
    lines += [f"| exposed comm / step | {_share(sh['predicted'])} | {_share(sh['measured'])} | "
              f"{_pct(sh['rel_error'])} |",
              f"| other (data, loss sync; measured only) | - | {_ms(t.get('other_s'))} | - |", "",
              f"Forward, backward and optimizer exclude the communication exposed in them "
              f"(forward {_ms(t['exposed_comm_by_phase']['forward'])}, backward "
              f"{_ms(t['exposed_comm_by_phase']['backward'])}, optimizer "
              f"{_ms(t['exposed_comm_by_phase']['optimizer'])} ms). Exposed communication measured by "
              f"{t['exposed_comm_method']}." + (f" ({t['exposed_comm_error']})" if t.get("exposed_comm_error") else ""),
              "", f"{tps} tokens/s; MFU {mfu}. Predicted: {t['note']}.", ""]
    pr = t["predicted"]
    lines += [f"Planned step {_ms(pr['step_s'])} ms: GEMM {_ms(pr['gemm_s'])}, attention {_ms(pr['attention_s'])}, "
              f"memory-bound {_ms(pr['memory_bound_s'])}, optimizer {_ms(pr['optimizer_s'])}, host "
              f"{_ms(pr['host_s'])}, exposed communication {_ms(pr['exposed_comm_s'])} ms.", ""]
    return lines


def write_report(out: Path, doc: dict[str, Any]) -> Path:
    """report.md plus its PNGs under `out`; returns the report's path."""
    points = doc["points"]
    cuda = doc["device"] == "cuda"
    lines = ["# shardwise bench", "", f"config `{doc['config']}`, {doc['steps']} steps, device {doc['device']}"
             + (f", launched by {doc['launcher']}" if doc.get("launcher") else ""),
             "", f"> {doc['memory_note']}", ""]
    if doc.get("incomplete"):
        inc = doc["incomplete"]
        lines += [f"> **Incomplete:** {inc['reason']} after {inc['measured']} of {inc['points']} points; not "
                  "measured: " + ", ".join(f"`{label}`" for label in inc["not_measured"]) + ".", ""]
    bound = [p for p in points if (p.get("comm_bound") or {}).get("bound")]
    if bound:
        lines += [f"**{len(bound)} of {len(points)} point(s) are communication-bound** (exposed communication "
                  f"over {bound[0]['comm_bound']['threshold']:.0%} of the measured step): "
                  + ", ".join(p["short"] for p in bound) + ". See each point's note.", ""]
    for i, p in enumerate(points):
        slug = f"{i:02d}"
        plot_states(p, out / f"states_{slug}.png")
        plot_memory(p, out / f"memory_{slug}.png")
        plot_timeline(p, out / f"timeline_{slug}.png")
        lines += [f"## {p['label']} ({p['strategy']}, {p['world_size']} ranks, micro-batch {p['micro_batch']}, "
                  f"grad_accum {p['grad_accum']})", "", *comm_bound_lines(p),
                  "### Model-state bytes per rank (planner vs census of the live engine, largest rank)", "",
                  "| term | predicted MiB | measured MiB | error |", "|---|---:|---:|---:|"]
        for t, v in p["model_states"].items():
            lines.append(f"| {t} | {_mib(v['predicted'])} | {_mib(v['measured'])} | {_pct(v['rel_error'])} |")
        lines += ["", f"![model states](states_{slug}.png)", "",
                  f"### Collective bytes per rank, step {p['comm_step']}"
                  + ("" if p["comm_steady_state"] else " (includes warm-up traffic: use --steps 3 or more)"), "",
                  "| kind | predicted MiB | measured MiB | error |", "|---|---:|---:|---:|"]
        for k, v in p["comm"].items():
            lines.append(f"| {k} | {_mib(v['predicted'])} | {_mib(v['measured'])} | {_pct(v['rel_error'])} |")
        kind = "CUDA allocator peaks per phase" if cuda else "host RSS at the end of each phase, not GPU memory"
        lines += ["", f"### Memory by phase ({kind})", "",
                  "| rank | forward MiB | backward MiB | optimizer MiB |", "|---|---:|---:|---:|"]
        key = "allocated_peak" if cuda else "rss"
        for r, phases in sorted(p["memory_by_phase"].items()):
            lines.append(f"| {r} | " + " | ".join(_mib(phases.get(ph, {}).get(key)) for ph in
                                                   ("forward", "backward", "optimizer")) + " |")
        if cuda and "memory_plan" in p:
            mp = p["memory_plan"]
            lines.append(f"| plan | {_mib(mp['forward'])} | {_mib(mp['forward'])} | {_mib(mp['step'])} |")
        tl = p["memory_timeline"]
        what = ("the CUDA allocator's allocated / reserved bytes" if cuda else
                "host memory (process RSS; not GPU memory)")
        snaps = [d["snapshot"] for d in tl["ranks"].values() if d.get("snapshot")]
        lines += ["", f"![memory by phase](memory_{slug}.png)", "",
                  f"### Memory timeline of one step (step {tl['step']})", "",
                  f"{what} at each decoder layer's forward and backward and at the phase boundaries; diamonds: "
                  "the census of model states at the ends of forward, backward and the optimizer step."
                  + (f" Allocator snapshots (https://pytorch.org/memory_viz): {', '.join(snaps)}." if snaps else ""),
                  "", f"![memory timeline](timeline_{slug}.png)", "", *_time_section(p)]
    plot_time(points, out / "time.png")
    lines += ["## Step time breakdown: predicted vs measured", "", "![step time](time.png)", ""]
    if len(points) > 1:
        plot_errors(points, out / "errors.png")
        lines += ["## Error vs strategy / micro-batch / sequence", "", "![errors](errors.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def print_table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    sweep = ", ".join(s.partition("=")[0] for s in doc["sweep"]) or "point"
    cols = (sweep, "model states MiB (pred / meas)", "err", "comm MiB (pred / meas)", "err",
            "fwd / bwd / opt / comm ms", "exposed comm (pred / meas)", "tokens/s")
    rows = []
    for p in doc["points"]:
        ms = p["model_states"]["model_states"]
        cp = sum(v["predicted"] or 0 for v in p["comm"].values())
        cm = sum(v["measured"] or 0 for v in p["comm"].values())
        tm = p["time"]
        m = {k: tm["terms"][k]["measured"] for k in ("forward", "backward", "optimizer", "exposed_comm")}
        sh = tm["terms"]["exposed_comm_share"]
        bound = " !" if (p.get("comm_bound") or {}).get("bound") else ""
        rows.append((p["short"], f"{_mib(ms['predicted'])} / {_mib(ms['measured'])}", _pct(ms["rel_error"]),
                     f"{_mib(cp)} / {_mib(cm)}", _pct(comm_total_error(p)),
                     " / ".join(f"{v * 1e3:.1f}" for v in m.values()),
                     f"{_share(sh['predicted'])} / {_share(sh['measured'])}{bound}",
                     rate(tm["tokens_per_s"]) if tm["tokens_per_s"] else "-"))
    title = f"shardwise bench: predicted vs measured ({doc['device']})"
    t = Table(title=title)
    for col in cols:
        t.add_column(col, justify="left" if col == sweep else "right")
    for r in rows:
        t.add_row(*r)
    console = Console()
    if console.measure(t, options=console.options.update_width(10**4)).maximum <= console.width:
        console.print(t)
    else:  # narrower than the table (a batch log without COLUMNS): one block per point, nothing cut
        console.print(escape(title), highlight=False)
        for r in rows:
            console.print(escape(r[0]), highlight=False, soft_wrap=True)
            labels = ("model states MiB (pred / meas)", "model states err", "comm MiB (pred / meas)", "comm err",
                      *cols[5:])
            for label, value in zip(labels, r[1:], strict=True):
                console.print(f"  {escape(label)}: {escape(value)}", highlight=False, soft_wrap=True)
    for p in doc["points"]:
        if (p.get("comm_bound") or {}).get("bound"):
            Console().print(f"[yellow]{escape(p['short'])}:[/] {escape(p['comm_bound']['message'])}", highlight=False)
