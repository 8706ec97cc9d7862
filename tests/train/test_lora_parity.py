"""LoRA trains the same adapters on every engine.

The parity setup of test_parity.py (tiny Llama, fp32, 8 steps, global batch 4 with unequal
target counts, clipping active) with LoRA rank 4 on every decoder linear. The reference is one
process; each engine runs on 2 gloo ranks with accumulation 1 and 2. Losses and adapters must
match within 1e-5 relative; the frozen base must come back bit for bit. The runs whose adapters
are compared use AdamW eps 1e-5, as test_parity.py's (its docstring: at the default 1e-8 the
update is sign-like in an element whose gradient is small next to its perturbation, and the
engines' summation order grows into lr-sized differences; measured here on this week's package
set: 1.07e-5 and 1.11e-5 on layer 1's o_proj lora_A at eps 1e-8, where the matrix had held 1e-5).
"""

from __future__ import annotations

import pytest
import torch
from parity_worker import parity_config

pytestmark = pytest.mark.distributed

STRATEGIES = ["ddp", "zero2", "zero3", "fsdp"]
GRAD_ACCUM = [1, 2]
RTOL = 1e-5
EPS = ":eps1e-5"  # AdamW eps of the runs whose adapters are compared (module docstring)
RUNS = [f"tiny-llama:{s}:{ga}:lora{EPS}" for s in STRATEGIES for ga in GRAD_ACCUM]
SAVE_RUNS = [f"tiny-llama:{s}:1:lorasave" for s in ("zero3", "fsdp")]


def initial_weights(flag: str) -> dict[str, torch.Tensor]:
    """The seeded starting point of the LoRA runs: base and fresh adapters, as the loop builds it."""
    from shardwise.run import run_spec
    from shardwise.train.model.build import build_model

    return build_model(run_spec(parity_config("ddp", 1, 1, flags=(flag,)), 1, "cpu")).state_dict()


@pytest.fixture(scope="module")
def reference(ranks_runner):
    out = ranks_runner([f"tiny-llama:ddp:1:lora{EPS}", "tiny-llama:ddp:1:lorasave"], nproc=1)
    return {"lora": torch.load(out / f"tiny-llama-ddp-1-lora{EPS.replace(':', '-')}-w1.pt"),
            "lorasave": torch.load(out / "tiny-llama-ddp-1-lorasave-w1.pt")}


@pytest.fixture(scope="module")
def runs(ranks_runner):
    return ranks_runner(RUNS + SAVE_RUNS, nproc=2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ (Frobenius; B matrices start at zero, so not elementwise)."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def _trained(name: str) -> bool:
    return ".lora_" in name or ".modules_to_save." in name


def test_reference_trains_only_the_adapters(reference):
    init = initial_weights("lora")
    w = reference["lora"]["weights"]
    assert w.keys() == init.keys()
    adapters = [k for k in w if _trained(k)]
    # rank 4 on q/k/v/o/gate/up/down of both layers: A and B each
    assert len(adapters) == 2 * 7 * 2
    for k in adapters:
        assert _rel(w[k], init[k]) > 100 * RTOL if "lora_A" in k else float(w[k].norm()) > 0, k
    for k in w.keys() - set(adapters):
        assert torch.equal(w[k], init[k]), f"frozen {k} changed"
    losses = reference["lora"]["losses"]
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("grad_accum", GRAD_ACCUM)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lora_matches_single_process(strategy, grad_accum, reference, runs):
    ref = reference["lora"]
    run = torch.load(runs / f"tiny-llama-{strategy}-{grad_accum}-lora{EPS.replace(':', '-')}-w2.pt")
    loss = max(abs(x - y) / abs(y) for x, y in zip(run["losses"], ref["losses"], strict=True))
    assert len(run["losses"]) == 8 and loss <= RTOL, f"{strategy} ga{grad_accum}: loss off by {loss:.2e}"
    w, rw = run["weights"], ref["weights"]
    assert w.keys() == rw.keys()
    adapters = {k: _rel(w[k], rw[k]) for k in w if _trained(k)}
    worst = max(adapters, key=adapters.get)
    assert adapters[worst] <= RTOL, f"{strategy} ga{grad_accum}: {worst} off by {adapters[worst]:.2e}"
    init = initial_weights("lora")
    frozen = [k for k in w if not _trained(k)]
    assert frozen and all(torch.equal(w[k], init[k]) for k in frozen), [k for k in frozen
                                                                        if not torch.equal(w[k], init[k])]


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_modules_to_save_match(strategy, reference, runs):
    """lm_head trained in full beside the adapters (PEFT's trainable copy): the copy trains, the
    original stays frozen, and both sharded engines match one process."""
    ref = reference["lorasave"]
    run = torch.load(runs / f"tiny-llama-{strategy}-1-lorasave-w2.pt")
    loss = max(abs(x - y) / abs(y) for x, y in zip(run["losses"], ref["losses"], strict=True))
    assert loss <= RTOL
    key = "lm_head.modules_to_save.default.weight"
    assert _rel(run["weights"][key], ref["weights"][key]) <= RTOL
    init = initial_weights("lorasave")
    assert _rel(run["weights"][key], init[key]) > 100 * RTOL
    assert torch.equal(run["weights"]["lm_head.original_module.weight"], init["lm_head.original_module.weight"])
