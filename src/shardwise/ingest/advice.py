"""`plan --from`'s last section: what to change in that file. The file's setting is planned,
then the recommender's sweep (shardwise.plan.recommend.sweep: micro-batch × checkpointing over
the strategies that file's format switches between, the global batch kept) gives the candidates;
each is written as the key: value edits of that format, and the fewest edits that make it fit,
then those that make it faster (each faster than any with fewer edits), are shown with their
planned memory and tokens/s. Before an edit is shown it is planned again through a copy of the file
with the edit applied (the caller's `replan`: shardwise.cli.advice_checks), and the figures shown
are that re-plan's: an edit whose copy plans another setting, is refused, or no longer fits (or is
no longer faster) is not shown, and is listed under "dropped" with why."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from shardwise.ingest.common import FORMAT_NAMES, Setting, Source
from shardwise.numfmt import rate
from shardwise.specs.hardware import GIB

MAX_SHOWN = 3
NO_CHANGE = ("no change to memory or time", "(no change to the plan)")  # how readers mark keys that change nothing


def _value(v: Any, fmt: str) -> str:
    if fmt in ("deepspeed", "training_args"):
        return json.dumps(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _setting(e) -> Setting:
    return Setting(e.strategy.name, e.train.micro_batch, e.train.grad_accum, e.train.checkpointing)


def _item(e, edits: dict[str, Any], base_tps: float | None, fmt: str) -> dict[str, Any]:
    t = e.time.tokens_per_s_per_gpu
    return {"edits": {k: v for k, v in edits.items()},
            "edits_text": [f"{k}: {_value(v, fmt)}" for k, v in edits.items()],
            "strategy": e.strategy.name, "micro_batch": e.train.micro_batch, "grad_accum": e.train.grad_accum,
            "checkpointing": e.train.checkpointing, "fits": e.fits,
            "memory_total": e.memory.gpu.total, "memory_required": e.memory.gpu.required,
            "usable_bytes": e.memory.usable_bytes, "tokens_per_s_per_gpu": t,
            "speedup": t / base_tps if base_tps else None}


# how many of the sweep's fastest candidates with one number of edits are planned again through
# the edited file before the fastest of them is shown (the sweep's figures can differ from the
# edited file's where the file's other keys change with the edit)
REPLANNED_PER_COUNT = 4


def advise(src: Source, m, hw, train, knobs, *, margin: float, accounting: str = "engine", tp: int = 1,
           pp: int = 1, replan: Callable[[dict[str, Any], Setting], Any] | None = None) -> Source:
    """Fill `src.advice` (and return `src`): at the planned layout (`tp`, `pp`: the file's, or the
    flags'), which the file's edits keep. `replan(edits, setting)` plans the file with `edits`
    applied (an Evaluation, or raises ShardwiseError); None: edits are shown unchecked."""
    from shardwise.errors import ShardwiseError
    from shardwise.plan.evaluate import evaluate
    from shardwise.plan.recommend import NEAR_TIE, sweep
    from shardwise.specs import Strategy

    name = (src.values.get("strategy") or [None])[0]
    if src.keys_of is None or name is None:
        src.advice = None
        return src
    current = evaluate(m, hw, train, Strategy.with_knobs(name, knobs, tp=tp, pp=pp), accounting=accounting,
                       margin=margin)
    # the file's keys as written: a shardwise YAML's `checkpointing.activation: auto` stays auto (an
    # edit to none or full pins it); other formats say none or full
    written = train.checkpointing if src.format == "shardwise" else current.train.checkpointing
    base_keys = src.keys_of(dataclasses.replace(_setting(current), checkpointing=written))
    family = [n for n in (src.family or (name,))]
    cands = sweep(m, hw, train, strategies=family, micro_batches=tuple(sorted({1, 2, 4, 8, train.micro_batch})),
                  checkpointing=tuple(dict.fromkeys(c for c in (train.checkpointing, "none", "full") if c != "auto")),
                  tps=(tp,), pps=(pp,),
                  margin=margin, knobs=knobs, accounting=accounting, base_layout=(tp, pp))
    dropped: list[dict[str, Any]] = []
    replanned: dict[str, Any] = {}

    def planned(e, edits: dict[str, Any], wanted: Callable[[Any], str | None]):
        """Candidate `e` as planning the file with `edits` applied gives it (its figures, not the
        sweep's); None, listed as dropped with why, where that plans another setting, is refused,
        or fails `wanted` (a reason, or None where the re-planned run is still wanted)."""
        if replan is None:
            return e
        key = json.dumps([edits, _setting(e).__dict__], sort_keys=True, default=str)
        if key not in replanned:
            got, why = _replanned(e, edits, replan)
            replanned[key] = got
            if why is not None:
                dropped.append(_item(e, edits, None, src.format) | {"why": why})
        got = replanned[key]
        if got is not None and (why := wanted(got)) is not None:
            dropped.append(_item(got, edits, None, src.format) | {"why": f"re-planned through the edited file, {why}"})
            replanned[key] = got = None
        return got

    def fitting(got) -> str | None:
        return None if got.fits else "it does not fit"

    rows = []
    for e in cands:
        try:
            keys = src.keys_of(_setting(e))
        except (ShardwiseError, KeyError, ValueError):
            continue
        edits = {k: v for k, v in keys.items() if base_keys.get(k) != v and v is not None}
        if edits and e.fits:
            rows.append((len(edits), e, edits))
    cur_tps = current.time.tokens_per_s_per_gpu
    out: dict[str, Any] = {"current": _item(current, {}, None, src.format), "to_fit": [], "faster": []}
    if not current.fits:
        out["shortfall"] = (f"{current.memory.gpu.required / GIB:.1f} GiB per GPU needed, "
                            f"{current.memory.usable_bytes / GIB:.1f} usable")
        fit = sorted(rows, key=lambda r: (r[0], -r[1].time.tokens_per_s_per_gpu))
        shown: list = []
        for n, e, edits in fit:
            if len(shown) == MAX_SHOWN:
                break
            if all(s[2] != edits for s in shown) and (got := planned(e, edits, fitting)) is not None:
                shown.append((n, got, edits))
        out["to_fit"] = [_item(e, ed, None, src.format) for _, e, ed in shown]
        if not shown and (saved := _with_savers(src, m, hw, train, knobs, family, margin, base_keys, tp, pp)):
            item, best = saved
            if (got := planned(best, item["edits"], fitting)) is not None:
                out["to_fit"] = [_item(got, item["edits"], None, src.format) | {"savers": True}]
        if not out["to_fit"] and set(family) == {"ddp"}:
            out["switch"] = _sharded(src, m, hw, train, knobs, margin, accounting, tp, pp)
        floor = max((e.time.tokens_per_s_per_gpu for _, e, _ in shown[:1]), default=0.0)
        base = shown[0][1].time.tokens_per_s_per_gpu if shown else None
    else:
        floor, base = cur_tps, cur_tps

    def faster(got) -> str | None:
        if not got.fits:
            return "it does not fit"
        if got.time.tokens_per_s_per_gpu <= floor * (1 + NEAR_TIE):
            return f"it is not more than {NEAR_TIE:.0%} faster"
        return None

    # per number of edits, the fastest run as re-planned among the sweep's fastest few
    best_by_n: dict[int, tuple] = {}
    tried: dict[int, int] = {}
    for n, e, edits in sorted(rows, key=lambda r: -r[1].time.tokens_per_s_per_gpu):
        if e.time.tokens_per_s_per_gpu <= floor * (1 + NEAR_TIE) or tried.get(n, 0) >= REPLANNED_PER_COUNT:
            continue
        tried[n] = tried.get(n, 0) + 1
        got = planned(e, edits, faster)
        if got is not None and (n not in best_by_n or got.time.tokens_per_s_per_gpu
                                > best_by_n[n][1].time.tokens_per_s_per_gpu):
            best_by_n[n] = (n, got, edits)
    frontier, top = [], floor
    for n in sorted(best_by_n):
        e = best_by_n[n][1]
        if e.time.tokens_per_s_per_gpu > top * (1 + NEAR_TIE):
            frontier.append(best_by_n[n])
            top = e.time.tokens_per_s_per_gpu
    out["faster"] = [_item(e, ed, base, src.format) for _, e, ed in frontier[:MAX_SHOWN]]
    out["checked"] = replan is not None
    # an edit that planned another candidate's setting is not left out where it is shown for its own
    shown_edits = [i["edits"] for i in (*out["to_fit"], *out["faster"])]
    out["dropped"] = [d for d in dropped if d["edits"] not in shown_edits]
    src.advice = out
    return src


def _with_savers(src: Source, m, hw, train, knobs, family: list[str], margin: float,
                 base_keys: dict[str, Any], tp: int = 1, pp: int = 1) -> tuple[dict[str, Any], Any] | None:
    """Where no edit of strategy, batch or checkpointing fits: the fewest memory savers that make
    a run of this file's strategies fit (shardwise.plan.recommend.with_savers), as this format's
    edits, with that run's evaluation; None where nothing does or the format cannot say a saver."""
    from shardwise.plan.recommend import with_savers

    if src.saver_keys is None or src.keys_of is None:
        return None
    rec = with_savers(m, hw, train, strategies=family, tps=(tp,), pps=(pp,), margin=margin, knobs=knobs,
                      base_layout=(tp, pp))
    said = src.saver_keys(rec.best.train) if rec is not None else None
    if not said:
        return None
    keys = src.keys_of(_setting(rec.best)) | said
    edits = {k: v for k, v in keys.items() if base_keys.get(k) != v and v is not None}
    return _item(rec.best, edits, None, src.format) | {"savers": True}, rec.best


# how a file limited to DDP (no key of its own switches engines) turns a sharding engine on
SWITCH = {
    "training_args": "give it deepspeed (a DeepSpeed JSON: zero_optimization.stage 3) or fsdp (\"full_shard\" "
                     "with fsdp_config)",
    "llama_factory": "add deepspeed: a DeepSpeed JSON (LLaMA-Factory ships examples/deepspeed/ds_z3_config.json), "
                     "or run it under an accelerate FSDP config",
    "axolotl": "add deepspeed: a DeepSpeed JSON (axolotl ships deepspeed_configs/zero3_bf16.json) or fsdp_version: 2 "
               "with fsdp_config",
}


def _sharded(src: Source, m, hw, train, knobs, margin: float, accounting: str, tp: int, pp: int) -> dict | None:
    """For a DDP file where nothing it can say fits: the fastest ZeRO/FSDP2 run that fits at its
    batch and layout (the recommender's sweep, as `plan -s` plans it), and how its format
    switches to it; None where none fits either."""
    from shardwise.config.strategy import STRATEGIES
    from shardwise.plan.recommend import sweep

    names = [n for n, f in STRATEGIES.items() if f.engine in ("deepspeed", "fsdp2")]
    cands = [e for e in sweep(m, hw, train, strategies=names, micro_batches=(train.micro_batch,),
                              checkpointing=tuple(dict.fromkeys((train.checkpointing, "full"))), tps=(tp,), pps=(pp,),
                              margin=margin, knobs=knobs, accounting=accounting, base_layout=(tp, pp)) if e.fits]
    if not cands:
        return None
    best = max(cands, key=lambda e: e.time.tokens_per_s_per_gpu)
    how = SWITCH.get(src.format, "switch it to a ZeRO or FSDP configuration")
    return _item(best, {}, None, src.format) | {"how": how}


def _replanned(e, edits: dict[str, Any], replan) -> tuple[Any, str | None]:
    """(the file planned with `edits` applied, None) where that plans candidate `e`'s setting;
    (None, why) where it plans another or is refused."""
    from shardwise.errors import ShardwiseError

    try:
        got = replan(edits, _setting(e))
    except ShardwiseError as err:
        return None, f"the edited file is refused: {err}"
    want = (e.strategy.name, e.train.micro_batch, e.train.grad_accum, e.train.checkpointing)
    have = (got.strategy.name, got.train.micro_batch, got.train.grad_accum, got.train.checkpointing)
    if have != want:
        return None, (f"the edited file plans {have[0]}, micro-batch {have[1]} × accum {have[2]}, checkpointing "
                      f"{have[3]}, not the {want[0]}, micro-batch {want[1]} × accum {want[2]}, checkpointing "
                      f"{want[3]} these edits were chosen for")
    return got, None


def _memory(item: dict) -> str:
    """The GPU memory an item needs against the usable bytes: `required`, what "fits" compares (a
    line that fits never reads above the usable figure), and the device total nvidia-smi would
    show where the allocator's reclaimable cache makes it larger."""
    need, total = item["memory_required"] / GIB, item["memory_total"] / GIB
    extra = f" (device total {total:.1f} with the allocator's reclaimable cache)" if total - need >= 0.05 else ""
    return f"{need:.1f} of {item['usable_bytes'] / GIB:.1f} usable GiB per GPU needed{extra}"


def _line(item: dict, fmt: str) -> str:
    nums = f"{_memory(item)}, {rate(item['tokens_per_s_per_gpu'])} tokens/s per GPU"
    if item.get("speedup"):
        nums += f" ({item['speedup'] - 1:+.0%})"
    what = (f"{item['strategy']}, micro-batch {item['micro_batch']} × accum {item['grad_accum']}, "
            f"checkpointing {item['checkpointing']}")
    return f"{'; '.join(item['edits_text'])}  → {what}: {nums}"


def print_source(console, src: Source) -> None:
    """The file's reading and the advice, after the plan's tables."""
    from rich.markup import escape

    p = lambda s="": console.print(escape(s), highlight=False, soft_wrap=True)  # noqa: E731
    p(f"Read from {src.path} ({FORMAT_NAMES[src.format]}):")
    quiet = [k for k, v in src.read if v.endswith(NO_CHANGE)]
    for k, v in src.read:
        if k not in quiet:
            p(f"  {k}: {v}")
    if quiet:
        p(f"  read, no change to memory or time: {', '.join(quiet)}")
    if src.ignored:
        p("Ignored (not planned):")
        for k, v in src.ignored:
            p(f"  {k}: {v}")
    for n in src.notes:
        p(f"  note: {n}")
    if src.command is not None:
        p(f"The same plan as flags: shardwise plan {' '.join(src.command)}")
    elif src.command_refused is not None:
        p(f"No command of flags plans the same: {src.command_refused}")
    a = src.advice
    if not a:
        return
    p(f"What to change in {src.path.name}:")
    cur = a["current"]
    if "shortfall" in a:
        p(f"  As written it does not fit ({a['shortfall']}).")
        if a["to_fit"] and a["to_fit"][0].get("savers"):
            p("  No edit of this file's strategy, micro-batch or checkpointing makes it fit here; with memory savers:")
            p(f"    - {_line(a['to_fit'][0], src.format)}")
        elif a["to_fit"]:
            p("  To fit (fewest edits first):")
            for item in a["to_fit"]:
                p(f"    - {_line(item, src.format)}")
        else:
            p("  No edit of this file's strategy, micro-batch or checkpointing makes it fit here.")
        if (sw := a.get("switch")) is not None:
            p("  DDP keeps the whole model, its gradients and optimizer states on every GPU; sharded, it fits: "
              f"{sw['how']}:")
            p(f"    - {_line(sw, src.format).strip().removeprefix('→').strip()}")
        elif "switch" in a:
            p("  Sharded by ZeRO or FSDP2 (any stage, with or without offload) it does not fit either.")
    else:
        p(f"  As written: {_memory(cur)}, {rate(cur['tokens_per_s_per_gpu'])} tokens/s per GPU.")
    if a.get("dropped"):
        p(f"  Left out: {len(a['dropped'])} edit(s) that, planned again through the edited file, plan another "
          "setting, are refused, or no longer fit or gain (--json: what_to_change.dropped, with why).")
    if a["faster"]:
        p("  To run faster:")
        for item in a["faster"]:
            p(f"    - {_line(item, src.format)}")
    elif "shortfall" not in a:
        p("  Nothing this file can switch to is more than 3% faster.")
