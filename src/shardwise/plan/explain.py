"""`shardwise explain`: ZeRO 1–3 vs FSDP for the user's model and hardware, in numbers. Every
comparison is read off the table it prints (or off the same evaluations at other GPU counts or
link bandwidths, which it names); nothing is fixed text about some other setup. Returns text;
the CLI prints it."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.numfmt import rate
from shardwise.plan.evaluate import checkpointing_choice, evaluate
from shardwise.plan.report import loss_words
from shardwise.specs import HardwareSpec, ModelSpec, Strategy, TrainSpec

GB = 1e9
NAMES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
SHOWN = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp": "FSDP2"}
SHARDS = {
    "ddp": "nothing: every GPU holds params, grads and optimizer states (16Ψ with mixed-precision Adam)",
    "zero1": "optimizer states (fp32 master + Adam moments, 12Ψ) over N GPUs",
    "zero2": "optimizer states and gradients (14Ψ) over N GPUs; 16-bit params stay whole",
    "zero3": "params, gradients and optimizer states (16Ψ); params all-gathered per layer when used",
    "fsdp": "like ZeRO-3 (FSDP2 full shard), per decoder layer, fp32 sharded params under bf16 compute",
}
TIE = 0.02  # tokens/s within 2% of each other: "about equal" (below the time model's resolution)
MAX_GPUS = 4096  # the GPU-count sweep's end
GRID = tuple(0.1e9 * 1.25**i for i in range(45))  # link bandwidths swept: 0.1 .. ~2,000 GB/s


@dataclass(frozen=True)
class Row:
    name: str
    model_states_gb: float
    total_gb: float
    required_gb: float
    usable_gb: float
    params_gb: float
    fits: bool
    ideal_comm_gb: float
    engine_comm_gb: float
    step_s: float
    tokens_per_s_per_gpu: float
    exposed: float


def _row(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, name: str) -> Row:
    e = evaluate(model, hw, train, Strategy.from_name(name))
    m = e.memory
    return Row(name=name, model_states_gb=m.gpu.model_states / GB, total_gb=m.gpu.total / GB,
               required_gb=m.gpu.required / GB, usable_gb=m.usable_bytes / GB, params_gb=m.gpu.params / GB,
               fits=m.fits, ideal_comm_gb=e.ideal.total / GB, engine_comm_gb=e.comm.total / GB,
               step_s=e.time.step_s, tokens_per_s_per_gpu=e.time.tokens_per_s_per_gpu,
               exposed=e.time.exposed_fraction)


def compare(model: ModelSpec, hw: HardwareSpec, train: TrainSpec) -> dict[str, Row]:
    train = comparable(model, hw, train)[0]
    return {n: _row(model, hw, train, n) for n in NAMES}


def comparable(model: ModelSpec, hw: HardwareSpec, train: TrainSpec) -> tuple[TrainSpec, str]:
    """`train` with one activation checkpointing for every row, so that the rows differ only in
    what they shard, and its words. `auto` decided per row (plan/recompute.py) would compare a
    row that recomputes with one that does not: here it is full in every row where some row fits
    only with it, else none."""
    if train.checkpointing != "auto":
        return train, f"checkpointing {train.checkpointing}"
    full = train.model_copy(update={"checkpointing": "full"})
    need = [n for n in NAMES if checkpointing_choice(model, hw, train, Strategy.from_name(n)).checkpointing == "full"
            and evaluate(model, hw, full, Strategy.from_name(n)).fits]
    if need:
        return full, f"checkpointing full in every row (auto: {', '.join(need)} fit{'s' if len(need) == 1 else ''} only with it)"
    return train.model_copy(update={"checkpointing": "none"}), "checkpointing none (auto: no row fits only with it)"


def relative(a: float, b: float) -> float:
    """a against b as a signed fraction (0.25: a is 25% above b)."""
    return a / b - 1 if b else 0.0


def _order(a: float, b: float) -> int:
    """+1 when a is faster than b by more than TIE, -1 when slower, 0 when within it."""
    r = relative(a, b)
    return 0 if abs(r) <= TIE else (1 if r > 0 else -1)


def _versus(rows: dict[str, Row], a: str, b: str, verb: str = "is ") -> str:
    """'FSDP2 is 25% slower than ZeRO-3 (44 vs 57 tokens/s per GPU)' from the table's rows."""
    ta, tb = rows[a].tokens_per_s_per_gpu, rows[b].tokens_per_s_per_gpu
    r = relative(ta, tb)
    if abs(r) <= TIE:
        how = f"within {TIE:.0%} of"
    else:
        how = f"{abs(r):.0%} {'faster' if r > 0 else 'slower'} than"
    return f"{SHOWN[a]} {verb}{how} {SHOWN[b]} ({_tokens(ta)} vs {_tokens(tb)} tokens/s per GPU)"


def _tokens(t: float) -> str:
    return f"{t:.1f}" if t < 100 else f"{t:,.0f}"


def _dp_link(hw: HardwareSpec) -> str:
    return "inter" if hw.nodes > 1 else "intra"


def bandwidth_segments(model: ModelSpec, hw: HardwareSpec, train: TrainSpec, a: str = "zero2",
                       b: str = "zero3") -> list[tuple[float, float, int, float]]:
    """The order of `a` and `b` in tokens/s as the bus bandwidth of the link the data-parallel
    traffic crosses sweeps GRID: (from, to, order, largest |difference|) per run of one order
    (order as `_order`: +1 a faster, -1 b faster, 0 within TIE)."""
    link = _dp_link(hw)
    segments: list[list] = []
    for bw in GRID:
        h = hw.model_copy(update={link: getattr(hw, link).model_copy(update={"bus_bytes_per_s": bw})})
        ta, tb = (evaluate(model, h, train, Strategy.from_name(n)).time.tokens_per_s_per_gpu for n in (a, b))
        o = _order(ta, tb)
        if segments and segments[-1][2] == o:
            segments[-1][1] = bw
            segments[-1][3] = max(segments[-1][3], abs(relative(ta, tb)))
        else:
            segments.append([bw, bw, o, abs(relative(ta, tb))])
    return [tuple(s) for s in segments]


def _bandwidth_text(model, hw, train, rows: dict[str, Row]) -> str:
    link = getattr(hw, _dp_link(hw))
    here = (f"On this {link.name} ({link.bus_bytes_per_s / GB:g} GB/s bus bandwidth per "
            f"{'NIC' if hw.nodes > 1 else 'GPU'}) the table has {_versus(rows, 'zero3', 'zero2', verb='')}.")
    segs = bandwidth_segments(model, hw, train)
    if len(segs) == 1:
        lo, hi, o, gap = segs[0]
        if o == 0:
            sweep = (f"Between {lo / GB:.1f} and {hi / GB:,.0f} GB/s the two stay within {TIE:.0%} of each other: "
                     "bandwidth does not choose between them here.")
        else:
            win = SHOWN["zero2" if o > 0 else "zero3"]
            sweep = (f"{win} stays faster (by up to {gap:.0%}) at every bandwidth from {lo / GB:.1f} to "
                     f"{hi / GB:,.0f} GB/s: bandwidth does not change the order here.")
    else:
        words = {1: "ZeRO-2 faster", -1: "ZeRO-3 faster", 0: f"within {TIE:.0%}"}
        parts = [f"{lo / GB:,.1f}–{hi / GB:,.1f} GB/s: {words[o]}" + (f" (by up to {gap:.0%})" if o else "")
                 for lo, hi, o, gap in segs]
        sweep = "Swept over the same link's bandwidth, ZeRO-2 vs ZeRO-3: " + "; ".join(parts) + "."
    fit = [n for n in ("zero2", "zero3") if rows[n].fits]
    if len(fit) == 1:
        sweep += f" Only {SHOWN[fit[0]]} fits here, so memory decides before bandwidth does."
    elif not fit:
        sweep += " Neither fits here, so this order matters only once memory allows one."
    return f"{here} {sweep}"


def _gpus_to_fit(model, hw, train, name: str) -> tuple[int | None, Row]:
    """The fewest GPUs (powers of two up to MAX_GPUS, the user's GPU, links and node size) at
    which `name` fits, and the row at that count (at MAX_GPUS when none fits)."""
    g, row = 1, None
    while g <= MAX_GPUS:
        per_node = min(g, hw.gpus_per_node)
        h = hw.model_copy(update={"gpus_per_node": per_node, "nodes": g // per_node})
        row = _row(model, h, train, name)
        if row.fits:
            return g, row
        g *= 2
    return None, row


def _gpu_count_text(model, hw, train, rows: dict[str, Row]) -> list[str]:
    out = []
    for name in ("zero2", "zero3"):
        r = rows[name]
        if name == "zero2" and r.params_gb >= r.usable_gb:
            out.append(
                f"ZeRO-2 never fits on {hw.gpu.name}: it keeps the whole 16-bit params on every GPU, 2Ψ = "
                f"{r.params_gb:.1f} GB, against {r.usable_gb:.1f} GB usable per GPU; its model states are 2Ψ + "
                f"14Ψ/N, which stays above 2Ψ however many GPUs are added.")
            continue
        g, at = _gpus_to_fit(model, hw, train, name)
        if g is None:
            out.append(f"{SHOWN[name]} does not fit on up to {MAX_GPUS:,} GPUs: there it still needs "
                       f"{at.required_gb:.1f} GB per GPU (model states {at.model_states_gb:.1f} GB"
                       + (f", of which the whole 16-bit params {at.params_gb:.1f} GB" if name == "zero2" else "")
                       + f") against {at.usable_gb:.1f} GB usable.")
        elif r.fits:
            out.append(f"{SHOWN[name]} fits on these {hw.world_size} GPUs ({r.required_gb:.1f} of "
                       f"{r.usable_gb:.1f} GB usable) and first fits at {g} GPU{'s' if g > 1 else ''}.")
        else:
            out.append(f"{SHOWN[name]} needs {r.required_gb:.1f} GB per GPU here against {r.usable_gb:.1f} GB "
                       f"usable; it first fits at {g} GPUs ({at.required_gb:.1f} GB).")
    return out


def _comm_text(rows: dict[str, Row], train: TrainSpec) -> list[str]:
    if rows["ddp"].ideal_comm_gb == 0:
        return ["One GPU: no data-parallel traffic."]
    b = train.compute_bytes
    two, three = rows["ddp"].ideal_comm_gb, rows["zero3"].ideal_comm_gb
    same = [SHOWN[n] for n in ("zero1", "zero2") if abs(relative(rows[n].ideal_comm_gb, two)) < 0.01]
    out = [f"Communication per GPU per step (ZeRO paper column): DDP{', ' + ' and '.join(same) if same else ''} "
           f"move{'s' if not same else ''} 2Ψ = {two:.1f} GB ({b}-byte elements); ZeRO-3 and FSDP move 3Ψ = "
           f"{three:.1f} GB ({relative(three, two) + 1:.2f}×)."
           + (" Sharding gradients (ZeRO-2) costs no extra traffic: the popular '1× / 2× / 3×' for ZeRO-1/2/3 is "
              "wrong." if "ZeRO-2" in same else "")]
    engine = [f"{SHOWN[n]} {rows[n].engine_comm_gb:.1f} GB ({rows[n].engine_comm_gb / rows[n].ideal_comm_gb:.2f}× "
              "the paper's)" for n in NAMES if rows[n].ideal_comm_gb]
    out.append("What the engines issue (engine column): " + ", ".join(engine) + ".")
    return out


def explain(model: ModelSpec, hw: HardwareSpec, train: TrainSpec) -> str:
    train, recompute = comparable(model, hw, train)
    rows = compare(model, hw, train)
    psi = model.params
    link = hw.intra if hw.nodes == 1 else hw.inter
    out = [
        f"# ZeRO stages vs FSDP for {model.name} (Ψ = {psi / 1e9:.2f}B) on {hw.world_size}× {hw.gpu.name} "
        f"({hw.gpu.memory_bytes / GB:.0f} GB), {link.name} between GPUs",
        "",
        "What each shards (mixed-precision Adam, ZeRO paper accounting: 2Ψ params + 2Ψ grads + 12Ψ optimizer):",
    ]
    out += [f"- {k}: {v}" for k, v in SHARDS.items()]
    out += ["", f"Per GPU, seq {train.seq_len} × micro-batch {train.micro_batch}, {train.precision}, {recompute}, "
            f"{loss_words(train, flag=False)}:", ""]
    out.append("| strategy | model states GB | peak GB | fits | comm/step paper GB | comm/step engine GB | step s | tokens/s/GPU |")
    out.append("|---|---|---|---|---|---|---|---|")
    for r in rows.values():
        out.append(f"| {r.name} | {r.model_states_gb:.1f} | {r.total_gb:.1f} | {'yes' if r.fits else 'no'} | "
                   f"{r.ideal_comm_gb:.1f} | {r.engine_comm_gb:.1f} | {r.step_s:.2f} | {rate(r.tokens_per_s_per_gpu)} |")
    out.append("")
    out += _comm_text(rows, train)
    if hw.world_size > 1:
        out.append(_bandwidth_text(model, hw, train, rows))
    out += _gpu_count_text(model, hw, train, rows)
    out.append(_fsdp_text(rows))
    return "\n".join(out)


def _fsdp_text(rows: dict[str, Row]) -> str:
    z3, fs = rows["zero3"], rows["fsdp"]
    said = f"FSDP2 vs ZeRO-3 here: {_versus(rows, 'fsdp', 'zero3')}"
    r = relative(fs.tokens_per_s_per_gpu, z3.tokens_per_s_per_gpu)
    if r < -TIE and fs.engine_comm_gb > 1.05 * z3.engine_comm_gb and fs.exposed > 0.05:
        said += (f": it issues {fs.engine_comm_gb:.1f} GB per step against ZeRO-3's {z3.engine_comm_gb:.1f} GB, and "
                 f"{fs.exposed:.0%} of its communication is exposed (ZeRO-3: {z3.exposed:.0%})")
    said += "."
    if fs.fits != z3.fits:
        said += f" Only {'FSDP2' if fs.fits else 'ZeRO-3'} fits ({fs.required_gb:.1f} vs {z3.required_gb:.1f} GB)."
    return (said + " Beyond speed: FSDP2 composes with TP/PP through DTensor; DeepSpeed ZeRO-3 adds optimizer/param "
            "offload to CPU/NVMe.")
