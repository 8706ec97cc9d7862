"""`shardwise bench`'s PNG plots (matplotlib, Agg): model states by term, memory by phase, the
memory timeline of one step, the step-time breakdown (predicted vs measured), and for sweeps
the error per point."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 2**20
STATE_TERMS = ("params", "grads", "master_params", "optimizer_states")
SPLIT = ("forward", "backward", "optimizer", "exposed_comm")
COLORS = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green", "exposed_comm": "tab:red",
          "other": "tab:gray"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, ax, path: Path, **legend: Any) -> None:
    """Legend, layout, PNG, and the figure closed (matplotlib keeps open ones alive)."""
    ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_states(point: dict[str, Any], path: Path) -> None:
    plt = _plt()
    terms = [*STATE_TERMS, "model_states"]
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


def plot_timeline(point: dict[str, Any], path: Path) -> None:
    """Memory over one step (the instrumented last one) per rank, with phase markers and the
    census of model states at the ends of forward, backward and the optimizer step. On CUDA the
    allocator's bytes; on CPU the change of the process's RSS since the step's start (its
    absolute value is mostly the interpreter and libraries), the census on the right axis."""
    plt = _plt()
    tl = point["memory_timeline"]
    cuda = tl["kind"] == "cuda_allocator"
    fig, ax = plt.subplots(figsize=(8, 4.2))
    cax = ax if cuda else ax.twinx()
    marked = False
    for j, (rank, d) in enumerate(sorted(tl["ranks"].items())):
        samples = d.get("samples") or []
        xs = [s["t_s"] * 1e3 for s in samples]
        base = 0.0 if cuda or not samples else samples[0]["bytes"]
        color = f"C{j}"
        what = "allocated" if cuda else "host RSS change"
        ax.plot(xs, [(s["bytes"] - base) / MIB for s in samples], "-", marker=".", ms=3, color=color,
                label=f"{rank} {what} (per-layer samples)")
        if cuda and samples and "reserved" in samples[0]:
            ax.plot(xs, [s["reserved"] / MIB for s in samples], ":", color=color, label=f"{rank} reserved")
        census = d.get("census") or []
        if census:
            cax.plot([c["t_s"] * 1e3 for c in census], [sum(c["bytes"].get(t, 0) for t in STATE_TERMS) / MIB
                                                        for c in census],
                     "D", color=color, ms=6, label=f"{rank} model states (census)")
        if not marked:
            for m in d.get("markers") or []:
                ax.axvline(m["t_s"] * 1e3, color="grey", ls="--", lw=0.8)
                ax.annotate(m["label"], (m["t_s"] * 1e3, 1.0), xycoords=("data", "axes fraction"),
                            rotation=90, va="top", ha="right", fontsize=7, color="grey")
            marked = bool(d.get("markers"))
    ax.set_xlabel("ms since the step's start (census pauses removed; collectives counted, so slower than timed steps)",
                  fontsize=8)
    if cuda:
        ax.set_ylabel("MiB (CUDA allocator)")
    else:
        ax.set_ylabel("MiB: host RSS minus its value at the step's start\n(host memory, not GPU memory)", fontsize=8)
        cax.set_ylabel("MiB: model states (census)", fontsize=8)
        cax.set_ylim(bottom=0)
        cax.legend(fontsize=7, loc="upper left")
    ax.set_title(f"memory timeline of one step (step {tl['step']}): {point['label']}"
                 + ("" if cuda else " — host memory"), fontsize=10)
    _save(plt, fig, ax, path, fontsize=7, loc="lower right")


def plot_time(points: list[dict[str, Any]], path: Path) -> None:
    """Per point two stacked bars: the planner's split and the measured one (median step)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 2.0 * len(points) + 2), 4.2))
    width = 0.38
    seen: set[str] = set()
    for i, p in enumerate(points):
        terms = p["time"]["terms"]
        for side, dx, hatch in (("predicted", -width / 2, "//"), ("measured", width / 2, "")):
            bottom = 0.0
            parts = [*SPLIT, "other"] if side == "measured" else list(SPLIT)
            for part in parts:
                v = (p["time"].get("other_s") or 0.0) if part == "other" else (terms[part][side] or 0.0)
                label = part if part not in seen else None
                seen.add(part)
                ax.bar(i + dx, v * 1e3, width, bottom=bottom, color=COLORS[part], hatch=hatch, edgecolor="white",
                       label=label)
                bottom += v * 1e3
    ax.set_xticks(range(len(points)), [f"{p['short']}\n(planned | measured)" for p in points], fontsize=8)
    ax.set_ylabel("ms per optimizer step")
    cpu = any(not p["time"].get("comparable", True) for p in points)
    ax.set_title("step time breakdown: predicted (hatched) vs measured"
                 + (" — plan prices a GPU, this ran on CPU" if cpu else ""), fontsize=10)
    _save(plt, fig, ax, path, fontsize=8)


def plot_errors(points: list[dict[str, Any]], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 1.5 * len(points) + 2), 3.8))
    labels = [p["short"] for p in points]

    def pct(ys):
        return [100 * y if y is not None else float("nan") for y in ys]

    for term in (*STATE_TERMS, "model_states"):
        ax.plot(range(len(points)), pct([p["model_states"][term]["rel_error"] for p in points]), marker="o",
                label=term)
    ax.plot(range(len(points)), pct([comm_total_error(p) for p in points]), "k--", marker="s",
            label="collective bytes")
    if all(p["time"].get("comparable") for p in points):  # time errors only where like is compared with like
        ax.plot(range(len(points)), pct([p["time"]["terms"]["step"]["rel_error"] for p in points]), "r:",
                marker="^", label="step time")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(points)), labels, rotation=15)
    ax.set_ylabel("(predicted - measured) / measured, %")
    ax.set_title("error vs sweep point")
    _save(plt, fig, ax, path, fontsize=7)


def comm_total_error(p: dict[str, Any]) -> float | None:
    pred = sum(t["predicted"] or 0 for t in p["comm"].values())
    meas = sum(t["measured"] or 0 for t in p["comm"].values())
    return (pred - meas) / meas if meas else None
