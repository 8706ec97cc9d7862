"""`plan --from`'s advice, checked by plan itself before it is printed: each edit planned again
through a copy of the file with the edit applied (`replanner`), and the "same plan as flags"
command parsed by plan's own command and planned through the same checks (`check_as_flags`).
Both go through plan_inputs and plan_setup, the path `shardwise plan` takes. Torch-free."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import typer
import yaml

from shardwise.cli.plan_inputs import plan_inputs, plan_setup
from shardwise.errors import ShardwiseError

# plan's parameters that say how to print or where to write, not what is planned, and the file itself
_NOT_PLANNED = frozenset({"from_file", "config", "set_", "as_json", "fmt", "emit", "emit_strategy"})


def _evaluate(a: dict, setup, name: str | None = None) -> Any:
    """Strategy `name` (default: the file's first) planned at the layout, as advise plans it."""
    from shardwise.plan.evaluate import evaluate
    from shardwise.specs import Strategy

    names = a.get("strategy") or []
    if name is None and not names:
        raise ShardwiseError("no strategy")
    strategy = Strategy.with_knobs(name or names[0], setup.knobs, tp=a["tp"] or 1, pp=a["pp"] or 1)
    return evaluate(setup.model, setup.hw, setup.train, strategy, accounting=a["accounting"], margin=a["margin"])


def replanner(ctx: typer.Context, knob_values: dict, source):
    """advise's `replan`: (edits, setting) -> the Evaluation of `source`'s file with `edits`
    applied, read and planned as `plan --from` reads and plans it, with the flags given beside it."""
    from shardwise.ingest.edit import edited_copy

    def replan(edits: dict[str, Any], setting) -> Any:
        with tempfile.TemporaryDirectory(prefix="shardwise-advice-") as d:
            try:
                try:
                    path, flags = edited_copy(source.path, edits, setting, Path(d))
                except (OSError, ValueError, TypeError, yaml.YAMLError) as e:  # a value its format cannot write
                    raise ShardwiseError(f"the edited copy could not be written: {e}") from None
                a, src = plan_inputs(ctx, knob_values, from_file=path, extra=flags)
                return _evaluate(a, plan_setup(a, src))
            except ShardwiseError as e:  # named as the user's file, not the copy
                raise ShardwiseError(str(e).replace(str(Path(d) / source.path.name), str(source.path))) from None

    return replan


def given_words(ctx: typer.Context, skip: frozenset[str] = _NOT_PLANNED) -> tuple[set[str], list[str]]:
    """(the plan parameters given on the command line, their words), outside `skip`: what was given
    beside a --from file, as it would be typed."""
    names, words = set(), []
    for p in ctx.command.params:
        if p.name in skip or p.name not in ctx.params:
            continue
        if getattr(ctx.get_parameter_source(p.name), "name", "") != "COMMANDLINE":
            continue
        v = ctx.params[p.name]
        names.add(p.name)
        if getattr(p, "is_flag", False) and not getattr(p, "multiple", False):
            words += [p.opts[0]] if v else ([p.secondary_opts[0]] if p.secondary_opts else [])
        elif getattr(p, "multiple", False):
            words += [w for x in v for w in (p.opts[0], str(x))]
        else:
            words += [p.opts[0], str(v)]
    return names, words


def check_as_flags(ctx: typer.Context, knob_values: dict, source, a: dict, setup,
                   planned: Sequence = ()) -> tuple[list[str] | None, str | None]:
    """(the `shardwise plan` words that plan what `source` plans, with the flags given beside it;
    None and why where plan refuses them or plans them otherwise). The words are parsed by plan's
    own command and planned through plan_setup; the specs must equal the file's, and each
    strategy's figures (the file's own: `planned`, plan's table rows, where one is that strategy
    as planned here; else planned again)."""
    from shardwise.config.flags import generated_parameters

    names, beside = given_words(ctx)
    words = [*source.as_flags(skip=frozenset(names)), *beside]
    generated = [p.name for p in generated_parameters()]
    try:
        sub = ctx.command.make_context(ctx.info_name or "plan", list(words), parent=ctx.parent)
    except Exception as e:  # click's usage errors: the words do not parse
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        return None, f"plan refuses them: {message}"
    try:
        with sub:
            knobs = {n: sub.params.pop(n, None) for n in generated}
            a2, _ = plan_inputs(sub, knobs)
            setup2 = plan_setup(a2, None)
            for what, x, y in (("the model", setup2.model, setup.model), ("the hardware", setup2.hw, setup.hw),
                               ("the training setup", setup2.train, setup.train),
                               ("the strategies", list(a2["strategy"] or ()), list(a["strategy"] or ())),
                               ("the layout", (a2["tp"] or 1, a2["pp"] or 1), (a["tp"] or 1, a["pp"] or 1))):
                if x != y:
                    return None, f"they plan {what} otherwise: {_diff(x, y)}"
            for name in a["strategy"] or ():
                got, want = _evaluate(a2, setup2, name), _planned_as(planned, a, setup, name)
                if _figures(got) != _figures(want):
                    return None, f"they plan {name} otherwise (its memory, traffic or time)"
    except ShardwiseError as e:
        return None, f"plan refuses them: {e}"
    return words, None


def _planned_as(planned: Sequence, a: dict, setup, name: str) -> Any:
    """The evaluation of strategy `name` at the file's layout: a row of `planned` planned with the
    very strategy `_evaluate` builds (knobs, layout) and the same accounting and margin, else anew."""
    from shardwise.specs import Strategy

    strategy = Strategy.with_knobs(name, setup.knobs, tp=a["tp"] or 1, pp=a["pp"] or 1)
    for e in planned:
        if e.strategy == strategy and e.model == setup.model and e.train == setup.train.for_engine(strategy.engine) \
                and e.memory.margin == _margin(a):
            return e
    return _evaluate(a, setup, name)


def _margin(a: dict) -> float:
    from shardwise.catalog import memory_model

    return memory_model().default_margin if a["margin"] is None else a["margin"]


def _figures(e) -> tuple:
    """What a plan shows of an evaluation (not the knobs it was planned with, some of which a
    strategy does not read)."""
    m = e.memory
    return (e.train, e.comm, e.ideal, e.time, m.gpu, m.host, m.capacity_bytes, m.margin, m.host_capacity_bytes,
            m.pipeline, m.fits)


def _diff(x: Any, y: Any) -> str:
    """The fields two specs differ in, as `field: flags' value vs file's`."""
    from dataclasses import fields, is_dataclass

    if is_dataclass(x) and is_dataclass(y) and type(x) is type(y):
        out = [f"{f.name} {getattr(x, f.name)!r} vs {getattr(y, f.name)!r}" for f in fields(x)
               if getattr(x, f.name) != getattr(y, f.name)]
        return "; ".join(out[:4])
    if hasattr(x, "model_dump") and hasattr(y, "model_dump"):
        dx, dy = x.model_dump(), y.model_dump()
        return "; ".join(f"{k} {dx.get(k)!r} vs {dy.get(k)!r}" for k in sorted(set(dx) | set(dy)) if dx.get(k) != dy.get(k))
    return f"{x!r} vs {y!r}"
