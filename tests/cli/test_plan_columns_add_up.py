"""`shardwise plan`'s memory table shows every part of `total`: for each strategy row of several
plans the printed columns before `total` (apart subtracting the parts not live at the peak) add
up to the printed total, within the rounding of the printed figures (0.005 GiB a figure), in the
full table and in the grouped one a narrower terminal gets; and the JSON's memory parts, less
`not_at_peak`, plus `runtime_overhead`, give its `total`, with `not_at_peak` never below zero (a
part the peak counted but the parts left out would show as a negative `not_at_peak`).

And FSDP2 under accumulation: llama-2-70b on 64 A100-80G at grad-accum 8 was planned with 257 GiB
of unsharded fp32 gradients held per GPU (the old default), a term the table did not show. The
default ("auto") now reduce-scatters every micro-batch there, says why, and the same plan with
activation checkpointing fits.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

GIB = 2**30
# the JSON memory keys that are allocated parts (docs/plan-json.md "memory")
PARTS = ("params", "grads", "master_params", "optimizer_states", "step_buffers", "activations", "recompute",
         "logits", "engine_buffers", "gathered_params", "held_grads", "grad_buffers", "ref_params", "ref_forward")
L70 = ("--model", "llama-2-70b", "--gpus", "64", "--gpu", "a100-80g", "--grad-accum", "8")
PLANS = {
    "70b-fsdp-held": (*L70, "-s", "fsdp", "--fsdp-reduce-every-micro-batch", "false"),
    "70b-fsdp-auto": (*L70, "-s", "fsdp", "-s", "fsdp-hybrid"),
    "7b-every-strategy": ("--model", "llama-2-7b", "--gpus", "8", "--grad-accum", "4", "--checkpointing", "full"),
    "7b-lora": ("--model", "llama-2-7b", "--gpus", "8", "--grad-accum", "4", "--lora-rank", "16",
                "--fsdp-reduce-every-micro-batch", "false"),
    "7b-offload": ("--model", "llama-2-7b", "--gpus", "8", "-s", "zero3+full-offload", "-s", "fsdp+offload",
                   "-s", "zero2+opt-offload", "--grad-accum", "2", "--fsdp-reduce-every-micro-batch", "false"),
    "13b-zero3": ("--model", "llama-2-13b", "--gpus", "16", "-s", "zero3", "--micro-batch", "2"),
    "7b-pp": ("--model", "llama-2-7b", "--gpus", "8", "--pp", "2", "--grad-accum", "8", "-s", "fsdp", "-s", "ddp",
              "-s", "zero1"),
}


def _shardwise(*args: str, columns: int = 400) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TERMINAL_WIDTH")}
    env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "shardwise.cli.app", "plan", *args], capture_output=True,
                          text=True, env=env, timeout=300, check=False)


def memory_table(out: str) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of the printed memory table: the first table, cells apart by 2+ spaces."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["strategy"])
    headers = re.split(r"\s{2,}", lines[head].strip())
    rows = []
    for line in lines[head + 2:]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    assert rows and all(len(r) == len(headers) for r in rows), (headers, rows)
    return headers, rows


def assert_columns_add_up(headers: list[str], rows: list[list[str]]) -> None:
    """The figures before `total` (but the strategy) sum to `total`, within 0.005 a figure."""
    t = headers.index("total")
    assert "apart" in headers[:t]
    for row in rows:
        figures = [float(x) for x in row[1:t]]
        tolerance = 0.005 * (len(figures) + 1) + 1e-9
        assert sum(figures) == pytest.approx(float(row[t]), abs=tolerance), dict(zip(headers, row, strict=True))
        assert float(row[headers.index("apart")]) <= 0


@pytest.fixture(scope="module")
def plans() -> dict[str, tuple[subprocess.CompletedProcess, subprocess.CompletedProcess, subprocess.CompletedProcess]]:
    """Each plan as the full table (wide), the grouped table (100 columns: too narrow for the full
    one, wide enough for every group beside the longest strategy name) and JSON."""
    out = {}
    for name, args in PLANS.items():
        wide, narrow, js = _shardwise(*args), _shardwise(*args, columns=100), _shardwise(*args, "--json")
        for r in (wide, narrow, js):
            assert r.returncode in (0, 3), (name, r.stdout[-2000:], r.stderr[-2000:])
        out[name] = (wide, narrow, js)
    return out


@pytest.mark.parametrize("name", list(PLANS))
def test_every_row_of_the_full_table_adds_up_to_its_total(plans, name):
    headers, rows = memory_table(plans[name][0].stdout)
    assert {"held", "gathered", "apart"} <= set(headers)
    assert len(rows) == len(json.loads(plans[name][2].stdout)["strategies"])
    assert_columns_add_up(headers, rows)


@pytest.mark.parametrize("name", list(PLANS))
def test_every_row_of_the_grouped_table_adds_up_to_its_total(plans, name):
    out = plans[name][1].stdout
    headers, rows = memory_table(out)
    # grouped at 100 columns, nothing of the memory table left out
    assert headers == ["strategy", "states", "activ+", "buffers+", "apart", "total", "need", "host", "fits"], headers
    assert_columns_add_up(headers, rows)


@pytest.mark.parametrize("name", list(PLANS))
def test_json_parts_less_not_at_peak_give_the_total(plans, name):
    doc = json.loads(plans[name][2].stdout)
    for row in doc["strategies"]:
        m = row["memory"]
        assert m["not_at_peak"] >= -1e-6 * m["total"], (row["name"], m)
        assert sum(m[k] for k in PARTS) - m["not_at_peak"] + m["runtime_overhead"] == pytest.approx(m["total"],
                                                                                                    rel=1e-12)
    # the table's figures are the JSON's, rounded
    headers, rows = memory_table(plans[name][0].stdout)
    for row, js in zip(rows, doc["strategies"], strict=True):
        shown = dict(zip(headers, row, strict=True))
        assert float(shown["held"]) == pytest.approx(js["memory"]["held_grads"] / GIB, abs=0.006)
        assert float(shown["gathered"]) == pytest.approx(js["memory"]["gathered_params"] / GIB, abs=0.006)
        assert float(shown["total"]) == pytest.approx(js["memory"]["total"] / GIB, abs=0.006)


def test_llama_70b_fsdp_at_grad_accum_8_reduces_every_micro_batch_and_says_why():
    """The reported plan: 257 GiB of held fp32 grads per GPU (4 bytes × 68.98e9 parameters) do not
    fit an 80 GB A100, so "auto" reduce-scatters every micro-batch."""
    args = (*L70, "-s", "fsdp")
    table, js = _shardwise(*args), _shardwise(*args, "--json")
    assert table.returncode == 0 and js.returncode == 0, (table.stderr, js.stderr)
    row = json.loads(js.stdout)["strategies"][0]
    sync = row["grad_sync"]
    assert sync["reduce_every_micro_batch"] is True and sync["chosen"] == "auto"
    assert sync["reduce_scatters_per_step"] == 8
    assert sync["held_grads_bytes"] == pytest.approx(4 * 68_976_648_192)  # fp32 reduce_dtype × Ψ
    assert row["memory"]["held_grads"] == 0
    assert "Gradient sync: fsdp: reduce-scatter every micro-batch (holding 257 GiB of unsharded grads would not fit" \
        in table.stdout
    assert_columns_add_up(*memory_table(table.stdout))
    held = json.loads(_shardwise(*args, "--json", "--fsdp-reduce-every-micro-batch", "false").stdout)["strategies"][0]
    assert held["memory"]["held_grads"] == pytest.approx(4 * 68_976_648_192)
    # the held grads were most of the plan: without them the total drops by more than their size
    # less the sharded grads that replace them (4 bytes × Ψ / 64 persist through the micro-batches)
    assert held["memory"]["total"] - row["memory"]["total"] > 0.9 * (4 * 68_976_648_192) * (1 - 1 / 64)


def test_llama_70b_fsdp_at_grad_accum_8_fits_with_checkpointing_only_without_held_grads():
    """Activations of micro-batch 4 × 2048 without checkpointing (203 GiB) do not fit either way;
    with full checkpointing the auto plan fits, the held-grads one does not."""
    args = (*L70, "-s", "fsdp", "--checkpointing", "full", "--json")
    auto = json.loads(_shardwise(*args).stdout)["strategies"][0]
    held = json.loads(_shardwise(*args, "--fsdp-reduce-every-micro-batch", "false").stdout)["strategies"][0]
    assert auto["fits"] and auto["grad_sync"]["reduce_every_micro_batch"] is True
    assert not held["fits"] and held["grad_sync"]["chosen"] == "set"


def test_llama_70b_fsdp_at_grad_accum_8_fits_as_typed():
    """The command as a user types it (checkpointing left to the plan, the schema's `auto`): its
    activations without recomputation (micro-batch 4 × 2048 tokens × 80 layers) do not fit an
    80 GB A100, so the plan checkpoints every layer, says so with the figure it decided on (the
    need of the same row planned with --checkpointing none), fits, and its columns add up."""
    args = (*L70, "-s", "fsdp")
    table, js = _shardwise(*args), _shardwise(*args, "--json")
    assert table.returncode == 0 and js.returncode == 0, (table.stderr, js.stderr)
    doc = json.loads(js.stdout)
    row = doc["strategies"][0]
    assert doc["train"]["checkpointing"] == "auto"
    assert row["fits"] and row["checkpointing"] == "full" and row["checkpointing_choice"]["chosen"] == "auto"
    assert row["grad_sync"]["reduce_every_micro_batch"] is True
    bare = json.loads(_shardwise(*args, "--json", "--checkpointing", "none").stdout)["strategies"][0]
    assert not bare["fits"]
    need = bare["memory"]["required"] / GIB
    assert f"without recomputation it would need {need:.1f} GiB of {bare['usable_bytes'] / GIB:.1f} usable" \
        in row["checkpointing_choice"]["reason"]
    assert (f"Activation checkpointing (auto): full; without recomputation each would need (GiB): fsdp {need:.1f} "
            f"of {bare['usable_bytes'] / GIB:.1f} usable") in " ".join(table.stdout.split())
    headers, rows = memory_table(table.stdout)
    assert rows[0][headers.index("fits")] == "yes"
    assert_columns_add_up(headers, rows)
