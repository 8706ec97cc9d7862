"""`shardwise bench` output: report.md with PNG plots (matplotlib, Agg) and the rich table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 2**20
STATE_TERMS = ("params", "grads", "master_params", "optimizer_states")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"



def _save(plt, fig, ax, path: Path) -> None:
    """Legend, layout, PNG, and the figure closed (matplotlib keeps open ones alive)."""
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MIB:,.2f}"


def plot_states(point: dict[str, Any], path: Path) -> None:
    plt = _plt()
    terms = [t for t in (*STATE_TERMS, "model_states")]
    pred = [(point["model_states"][t]["predicted"] or 0) / MIB for t in terms]
    meas = [(point["model_states"][t]["measured"] or 0) / MIB for t in terms]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    x = range(len(terms))
    ax.bar([i - 0.2 for i in x], pred, 0.4, label="predicted (plan)")
    ax.bar([i + 0.2 for i in x], meas, 0.4, label="measured (census, max rank)")
    ax.set_xticks(list(x), terms, rotation=15)
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"model-state bytes: {point['label']}")
    _save(plt, fig, ax, path)


def plot_memory(point: dict[str, Any], path: Path) -> None:
    plt = _plt()
    cuda = point["memory_kind"] == "cuda_allocator"
    key = "allocated_peak" if cuda else "rss"
    ranks = sorted(point["memory_by_phase"])
    phases = ("forward", "backward", "optimizer")
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / max(len(ranks), 1)
    for j, r in enumerate(ranks):
        vals = [point["memory_by_phase"][r].get(ph, {}).get(key, 0) / MIB for ph in phases]
        ax.bar([i + (j - (len(ranks) - 1) / 2) * width for i in range(3)], vals, width, label=r)
    if cuda and "memory_plan" in point:
        mp = point["memory_plan"]
        ax.plot(range(3), [mp["forward"] / MIB, mp["forward"] / MIB, mp["step"] / MIB], "k--", marker="o",
                label="plan (allocated)")
    ax.set_xticks(range(3), phases)
    ax.set_ylabel("MiB " + ("(CUDA allocated peak of the phase)" if cuda else "(host RSS: not GPU memory)"))
    ax.set_title(f"memory by phase: {point['label']}")
    _save(plt, fig, ax, path)


def plot_time(points: list[dict[str, Any]], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 1.5 * len(points) + 2), 3.8))
    bottom = [0.0] * len(points)
    for part in ("forward_s", "backward_s", "optimizer_s", "other_s"):
        vals = [(p["time"].get(part) or 0.0) * 1e3 for p in points]
        ax.bar(range(len(points)), vals, 0.6, bottom=bottom, label=part.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(range(len(points)), [p["short"] for p in points], rotation=15)
    ax.set_ylabel("ms per optimizer step (median)")
    ax.set_title("step time breakdown")
    _save(plt, fig, ax, path)


def plot_errors(points: list[dict[str, Any]], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 1.5 * len(points) + 2), 3.8))
    labels = [p["short"] for p in points]
    for term in (*STATE_TERMS, "model_states"):
        ys = [p["model_states"][term]["rel_error"] for p in points]
        ax.plot(range(len(points)), [100 * y if y is not None else float("nan") for y in ys], marker="o", label=term)
    comm = [_comm_total_error(p) for p in points]
    ax.plot(range(len(points)), [100 * y if y is not None else float("nan") for y in comm], "k--", marker="s",
            label="collective bytes")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(points)), labels, rotation=15)
    ax.set_ylabel("(predicted - measured) / measured, %")
    ax.set_title("error vs sweep point")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _comm_total_error(p: dict[str, Any]) -> float | None:
    pred = sum(t["predicted"] or 0 for t in p["comm"].values())
    meas = sum(t["measured"] or 0 for t in p["comm"].values())
    return (pred - meas) / meas if meas else None


def write_report(out: Path, doc: dict[str, Any]) -> Path:
    """report.md plus its PNGs under `out`; returns the report's path."""
    points = doc["points"]
    cuda = doc["device"] == "cuda"
    lines = ["# shardwise bench", "", f"config `{doc['config']}`, {doc['steps']} steps, device {doc['device']}",
             "", f"> {doc['memory_note']}", ""]
    for i, p in enumerate(points):
        slug = f"{i:02d}"
        plot_states(p, out / f"states_{slug}.png")
        plot_memory(p, out / f"memory_{slug}.png")
        lines += [f"## {p['label']} ({p['strategy']}, {p['world_size']} ranks, micro-batch {p['micro_batch']}, "
                  f"grad_accum {p['grad_accum']})", "",
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
        kind = "CUDA allocator peaks per phase" if cuda else "host RSS at the end of each phase (not GPU memory)"
        lines += ["", f"### Memory by phase ({kind})", "",
                  "| rank | forward MiB | backward MiB | optimizer MiB |", "|---|---:|---:|---:|"]
        key = "allocated_peak" if cuda else "rss"
        for r, phases in sorted(p["memory_by_phase"].items()):
            lines.append(f"| {r} | " + " | ".join(_mib(phases.get(ph, {}).get(key)) for ph in
                                                   ("forward", "backward", "optimizer")) + " |")
        if cuda and "memory_plan" in p:
            mp = p["memory_plan"]
            lines.append(f"| plan | {_mib(mp['forward'])} | {_mib(mp['forward'])} | {_mib(mp['step'])} |")
        t = p["time"]
        tps = f"{t['tokens_per_s']:,.0f}" if t["tokens_per_s"] else "-"
        mfu = f"{t['mfu']:.1%}" if t.get("mfu") else "- (no GPU peak on CPU)"
        lines += ["", f"![memory by phase](memory_{slug}.png)", "", "### Step time (median of steps "
                  f"{t['timed_steps']})", "",
                  f"forward {t['forward_s'] * 1e3:.1f} ms, backward {t['backward_s'] * 1e3:.1f} ms, optimizer "
                  f"{t['optimizer_s'] * 1e3:.1f} ms, step {(t['step_s'] or 0) * 1e3:.1f} ms; {tps} tokens/s; MFU {mfu}",
                  ""]
        if t.get("predicted"):
            pr = t["predicted"]
            where = "" if cuda else " (on CPU: the plan prices the GPU the config names, not this CPU)"
            lines += [f"Planned step {pr['step_s'] * 1e3:.1f} ms: GEMM {pr['gemm_s'] * 1e3:.1f}, attention "
                      f"{pr['attention_s'] * 1e3:.1f}, memory-bound {pr['memory_bound_s'] * 1e3:.1f}, optimizer "
                      f"{pr['optimizer_s'] * 1e3:.1f}, host {pr['host_s'] * 1e3:.1f}, exposed communication "
                      f"{pr['exposed_comm_s'] * 1e3:.1f} ms{where}.", ""]
    plot_time(points, out / "time.png")
    lines += ["## Step time breakdown", "", "![step time](time.png)", ""]
    if len(points) > 1:
        plot_errors(points, out / "errors.png")
        lines += ["## Error vs strategy / micro-batch", "", "![errors](errors.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def print_table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    sweep = ", ".join(s.partition("=")[0] for s in doc["sweep"]) or "point"
    t = Table(title=f"shardwise bench: predicted vs measured ({doc['device']})")
    for col in (sweep, "model states MiB (pred / meas)", "err", "comm MiB (pred / meas)", "err",
                "fwd / bwd / opt ms", "tokens/s"):
        t.add_column(col, justify="left" if col == sweep else "right")
    for p in doc["points"]:
        ms = p["model_states"]["model_states"]
        cp = sum(v["predicted"] or 0 for v in p["comm"].values())
        cm = sum(v["measured"] or 0 for v in p["comm"].values())
        tm = p["time"]
        t.add_row(p["short"], f"{_mib(ms['predicted'])} / {_mib(ms['measured'])}", _pct(ms["rel_error"]),
                  f"{_mib(cp)} / {_mib(cm)}", _pct(_comm_total_error(p)),
                  f"{tm['forward_s'] * 1e3:.1f} / {tm['backward_s'] * 1e3:.1f} / {tm['optimizer_s'] * 1e3:.1f}",
                  f"{tm['tokens_per_s']:,.0f}" if tm["tokens_per_s"] else "-")
    Console().print(t)
