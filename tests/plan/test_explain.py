"""`shardwise explain` says only what its own table shows: each statement the
issue quoted as wrong, on the setup it was quoted for, checked against the table printed beside it
and against arithmetic done here (Ψ from the catalog, GPU memory from hardware.yaml)."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from shardwise import catalog
from shardwise.cli.app import app

runner = CliRunner()

# One sequence per GPU per step: a step dominated by its collectives on these slow links (the
# trainer's default micro-batch of 4 amortises them)
SEVENTY_ETH = ("--model", "llama-2-70b", "--gpus", "8", "--gpus-per-node", "1", "--interconnect", "eth-10",
               "--micro-batch", "1")
PCIE_4090 = ("--gpu", "rtx-4090", "--gpus-per-node", "8", "--interconnect", "pcie", "--micro-batch", "1",
             "--checkpointing", "none")


def _explain(*args) -> str:
    """explain's text as written (markdown: its table whole, whatever the terminal's width)."""
    res = runner.invoke(app, ["explain", "--format", "markdown", *args])
    assert res.exit_code == 0, res.output
    return res.output


def _table(out: str) -> dict[str, dict[str, float]]:
    """The markdown table's rows: strategy -> step s and tokens/s/GPU as printed."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
            rows[cells[0]] = {"step_s": float(cells[6]), "tokens": float(cells[7].replace(",", "")),
                              "fits": cells[3] == "yes"}
    assert set(rows) == {"ddp", "zero1", "zero2", "zero3", "fsdp"}, out
    return rows


def _prose(out: str) -> str:
    """The text after the table, one line (wrapping removed)."""
    return " ".join(out.split("|---|")[-1].split("\n", 1)[1].split())


def test_no_fixed_section_and_the_text_follows_the_input():
    a, b = _explain(), _explain(*SEVENTY_ETH)
    for out in (a, b):
        assert "seed material" not in out and "scenarios, recomputed" not in out
    # no sentence with a figure in it (GB, %, tokens/s, GPUs) is the same for two different setups
    sa = set(re.split(r"(?<=\.) ", _prose(a)))
    sb = set(re.split(r"(?<=\.) ", _prose(b)))
    shared = {s for s in sa & sb if re.search(r"\d[\d.,]* ?(GB|%|tokens|GPU)", s)}
    assert not shared, shared


def test_zero2_never_fits_70b_on_80gb_says_why_in_numbers():
    # llama-2-70b: 2Ψ of bf16 params = 2 · 68.98e9 B = 138.0 GB, above an 80 GB card's
    # 81920 MiB · (1 − 0.05 margin) = 81.6 GB usable, whatever N in 2Ψ + 14Ψ/N
    psi = catalog.get_model("llama-2-70b").params
    usable = 81920 * 2**20 * 0.95 / 1e9
    for args in ((), SEVENTY_ETH):
        out = " ".join(_explain(*(args or ("--model", "llama-2-70b"))).split())
        assert ">256" not in out and "first fits at >" not in out
        assert "ZeRO-2 never fits on a100-80g" in out
        assert f"2Ψ = {2 * psi / 1e9:.1f} GB" in out and f"{usable:.1f} GB usable" in out


def _pct_slower(rows, a, b) -> int:
    # tokens per step are the same for every row: tokens/s ratio = inverse step-time ratio
    return round((1 - rows[b]["step_s"] / rows[a]["step_s"]) * 100)


@pytest.mark.parametrize("args", [SEVENTY_ETH, PCIE_4090], ids=["70b-eth-10", "7b-4090-pcie"])
def test_fsdp_vs_zero3_is_read_off_the_table(args):
    out = _explain(*args)
    rows, prose = _table(out), _prose(out)
    assert "within a few percent" not in prose and "On NVLink" not in prose
    slower = _pct_slower(rows, "fsdp", "zero3")
    assert slower >= 20  # the table's own rows: FSDP2's fp32 reduce-scatter on a slow link
    m = re.search(r"FSDP2 is (\d+)% slower than ZeRO-3", prose)
    assert m, prose
    assert abs(int(m.group(1)) - slower) <= 1  # the table's step times are rounded to 0.01 s


def test_fsdp_within_on_nvlink_when_the_table_says_so():
    out = _explain()  # llama-2-7b, 8× A100 NVLink: FSDP2 3,158 vs ZeRO-3 3,204 in the table
    rows, prose = _table(out), _prose(out)
    gap = abs(rows["fsdp"]["tokens"] / rows["zero3"]["tokens"] - 1)
    if gap <= 0.02:
        assert "FSDP2 is within 2% of ZeRO-3" in prose
    else:
        assert f"{round(gap * 100)}%" in prose


def test_crossover_agrees_with_the_table_beside_it():
    out = _explain(*SEVENTY_ETH)
    rows, prose = _table(out), _prose(out)
    # the table: ZeRO-2 and ZeRO-3 equal on eth-10 (both ~368 s a step)
    assert abs(rows["zero2"]["step_s"] / rows["zero3"]["step_s"] - 1) < 0.02
    assert "above ~0.1 GB/s ZeRO-3 is faster" not in prose and "above it ZeRO-3 is faster" not in prose
    assert "On this eth-10 (1 GB/s" in prose and "the table has ZeRO-3 within 2% of ZeRO-2" in prose
    # the sweep's segment holding the link's own 1 GB/s says the same as the table
    seg = re.search(r"0\.1–([\d.]+) GB/s: within 2%", prose)
    assert seg and float(seg.group(1)) >= 1.0, prose
    # and where ZeRO-3 is faster on a fast link, the sentence says so with the table's numbers
    nv = _explain("--model", "llama-2-70b")
    rows_nv, prose_nv = _table(nv), _prose(nv)
    faster = round((rows_nv["zero3"]["tokens"] / rows_nv["zero2"]["tokens"] - 1) * 100)
    assert f"the table has ZeRO-3 {faster}% faster than ZeRO-2" in prose_nv


def test_auto_checkpointing_is_one_setting_for_every_row():
    """Left to the plan, checkpointing is the same in every row (the rows differ only in what they
    shard): full where some row fits only with it, as every row planned with --checkpointing full."""
    args = ("--model", "llama-2-13b", "--micro-batch", "8")
    out = _explain(*args)
    rows = _table(out)
    assert "checkpointing full in every row (auto: " in " ".join(out.split())
    assert rows == _table(_explain(*args, "--checkpointing", "full"))
    bare = _table(_explain(*args, "--checkpointing", "none"))
    assert any(rows[n]["fits"] and not bare[n]["fits"] for n in rows)
    # where none fits only with it, none in every row
    one = ("--model", "llama-2-7b", "--seq-len", "512", "--micro-batch", "1")
    out = _explain(*one)
    assert "checkpointing none (auto: no row fits only with it)" in " ".join(out.split())
    assert _table(out) == _table(_explain(*one, "--checkpointing", "none"))
