"""Megatron-Core's distributed optimizer (`--zero-impl megatron` on zero1; plan-only): memory,
traffic and exposure against hand arithmetic from Megatron's source (an fp32 gradient buffer the
size of the model for bf16, kept across steps; fp32 main params and Adam sharded; one
reduce-scatter per step into the buffer and one all-gather of the updated params), its refusals,
the CLI, and Megatron-SWIFT's two MoE memory figures it was built for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise import catalog
from shardwise.config.strategy import DeepSpeedKnobs, FSDPKnobs
from shardwise.errors import ShardwiseError
from shardwise.plan.comm import plan_comm
from shardwise.plan.evaluate import evaluate
from shardwise.plan.memory import plan_memory
from shardwise.specs import Strategy, TrainSpec

M7 = catalog.get_model("llama-2-7b")
PSI = M7.params
HW16 = catalog.build_hardware(gpu="h100-sxm", gpus=16)
TRAIN = TrainSpec(micro_batch=1, seq_len=4096, grad_accum=4, checkpointing="full")  # bf16-mixed


def zero1(impl: str = "megatron", **ds) -> Strategy:
    return Strategy.from_name("zero1", zero_impl=impl, ds=DeepSpeedKnobs(**ds))


def test_model_states_are_megatrons():
    gpu = plan_memory(M7, HW16, TRAIN, zero1()).gpu
    assert gpu.params == 2 * PSI  # Float16Module
    assert gpu.grads == 4 * PSI and gpu.grads_persist  # the fp32 main-grad buffer, whole, every phase
    assert gpu.master_params == pytest.approx(4 * PSI / 16) and gpu.optimizer_states == pytest.approx(8 * PSI / 16)
    assert gpu.step_buffers == 0 and gpu.grad_buffers == 0  # no partition copy, no buckets beside the buffer
    ds = plan_memory(M7, HW16, TRAIN, zero1("deepspeed")).gpu
    assert ds.grads == 2 * PSI and ds.step_buffers > 0  # DeepSpeed: 16-bit grads, an fp32 partition at step


def test_one_reduce_scatter_in_fp32_and_one_all_gather_per_step():
    comm = plan_comm(M7, HW16, TRAIN, zero1())
    assert comm.reduce_scatter == 4 * PSI and comm.all_gather == 2 * PSI  # whatever the accumulation (4)
    assert comm.all_reduce == 0 and comm.reduce == 0
    buckets = PSI // 40_000_000 + 1  # Megatron's bucket_size: max(40M, 1M × dp 16)
    assert comm.calls == 2 * buckets


def test_overlap_hides_the_param_gather_and_no_deepspeed_host_work():
    two_nodes = catalog.build_hardware(gpu="h100-sxm", gpus=16, gpus_per_node=8, interconnect="eth-100")
    plain = evaluate(M7, two_nodes, TRAIN, zero1()).time
    overlapped = evaluate(M7, two_nodes, TRAIN, zero1(overlap_comm=True)).time
    # without --overlap-grad-reduce --overlap-param-gather (Megatron's default) nothing hides
    assert plain.exposed_comm_s == pytest.approx(plain.comm_s)
    assert overlapped.exposed_comm_s < plain.exposed_comm_s
    deepspeed = evaluate(M7, two_nodes, TRAIN, zero1("deepspeed", overlap_comm=True)).time
    assert overlapped.exposed_comm_s < deepspeed.exposed_comm_s  # DeepSpeed's post-step gather stays exposed
    assert overlapped.host_s < deepspeed.host_s  # no DeepSpeed step and per-tensor hooks


@pytest.mark.parametrize("name", ["zero2", "zero3", "fsdp", "ddp", "zero1+opt-offload"])
def test_other_strategies_refuse_it(name):
    with pytest.raises(ShardwiseError, match="distributed optimizer"):
        Strategy.from_name(name, zero_impl="megatron")


def test_lora_is_refused():
    with pytest.raises(ShardwiseError, match="full fine-tuning"):
        plan_memory(M7, HW16, TRAIN.model_copy(update={"lora_rank": 8}), zero1())


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", *args], capture_output=True, text=True,
                          timeout=300, check=False)


def test_plan_cli_plans_the_zero1_row_with_it():
    base = ["--model", "llama-2-7b", "--gpu", "h100-sxm", "--gpus", "16", "-s", "zero1", "-s", "zero3",
            "--micro-batch", "1", "--seq-len", "4096", "--checkpointing", "full", "--json"]
    r = _plan(*base, "--zero-impl", "megatron")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {s["name"]: s for s in json.loads(r.stdout)["strategies"]}
    assert rows["zero1"]["memory"]["grads"] == 4 * PSI  # the fp32 buffer: Megatron's
    assert rows["zero3"]["memory"]["grads"] == pytest.approx(2 * PSI / 16)  # the other rows keep DeepSpeed's
    bad = _plan(*base, "--zero-impl", "apex")
    assert bad.returncode != 0 and "--zero-impl 'apex': expected deepspeed or megatron" in bad.stdout + bad.stderr


def test_megatron_swift_moe_peaks():
    """Megatron-SWIFT's MoE examples (benchmarks/published/megatron-moe-expert-parallel.yaml):
    60 and 57 GiB reserved; planned -17% with DeepSpeed's 16-bit gradients, within 10% with
    Megatron's fp32 buffer."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import accuracy

    rows = [r for r in accuracy.load_runs() if r["_source"]["id"] == "megatron-moe-expert-parallel"
            and "peak_memory_gib" in r["published"]]
    assert len(rows) == 2
    for row in rows:
        assert row["_source"]["zero_impl"] == "megatron"
        assert abs(accuracy.compare(row)["memory_rel_err"]) <= 0.10, row["name"]


def test_tensor_and_pipeline_launches_are_not_priced_as_data_parallel_ones():
    """Under TP 8 × PP 2 the step's data-parallel launches are still the optimizer's 2 per bucket;
    the TP all-reduces and PP sends are counted apart (`blocking_calls`, at the NVLink step
    latency on the critical path). They were once added to `calls`, which plan/network.comm_time
    prices at the data-parallel ring's latency: on 48 nodes 47 inter-node steps of 14 us each,
    which planned the Megatron-LM README's 32B TP-8 row 0.5 s a step slower."""
    hw = catalog.build_hardware(gpu="h100-sxm", gpus=768, gpus_per_node=8)
    s = Strategy.from_name("zero1", zero_impl="megatron", tp=8, pp=2, ds=DeepSpeedKnobs(overlap_comm=True))
    comm = plan_comm(M7, hw, TRAIN, s)
    rank_params = evaluate(M7, hw, TRAIN, s).memory.gpu.params / 2  # this rank's 16-bit parameters
    buckets = int(rank_params // max(40_000_000, 1_000_000 * 48)) + 1
    assert comm.calls == 2 * buckets
    layers_per_stage, k = M7.num_layers // 2, TRAIN.grad_accum
    assert comm.blocking_calls >= 4 * layers_per_stage * k  # 2 TP pairs a layer each way, and the PP sends


# --- its precision settings: the bf16 gradient buffer and fp8 parameters ----------------------
# llama-2-7b's decoder linears (q, k, v, o: h × h each; gate, up, down: h × I), from its
# config.json shape: hidden 4096, intermediate 11008, 32 layers, no GQA
LINEARS = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
FP8 = TrainSpec(micro_batch=1, seq_len=4096, grad_accum=4, checkpointing="full", fp8="tensorwise")


def test_bf16_gradient_buffer_halves_the_buffer_and_its_reduce_scatter():
    s = Strategy.from_name("zero1", zero_impl="megatron", grad_reduce_in_bf16=True)
    gpu = plan_memory(M7, HW16, TRAIN, s).gpu
    assert gpu.grads == 2 * PSI and gpu.grads_persist
    assert gpu.master_params == pytest.approx(4 * PSI / 16)  # the fp32 main params stay
    comm = plan_comm(M7, HW16, TRAIN, s)
    assert comm.reduce_scatter == 2 * PSI and comm.all_gather == 2 * PSI
    # an fp32 run's buffer is fp32 whatever the flag says of bf16 (Megatron reads it for bf16 only)
    fp32 = TRAIN.model_copy(update={"precision": "fp32"})
    assert plan_memory(M7, HW16, fp32, s).gpu.grads == 4 * PSI


def test_fp8_param_gather_keeps_the_linears_in_fp8_and_gathers_them_so():
    s = Strategy.from_name("zero1", zero_impl="megatron")
    plain = plan_memory(M7, HW16, FP8, s).gpu
    fp8 = FP8.model_copy(update={"fp8_all_gather": True})
    gpu = plan_memory(M7, HW16, fp8, s).gpu
    assert plain.params == 2 * PSI
    assert gpu.params == pytest.approx(2 * PSI - LINEARS)  # one byte for each linear weight
    assert gpu.grads == plain.grads and gpu.master_params == plain.master_params  # fp32 main params unchanged
    assert plan_comm(M7, HW16, fp8, s).all_gather == pytest.approx(2 * PSI - LINEARS)
    # the casts: the weights' once a step, on the rank's 1/16 shard, where tensorwise casts them in
    # every micro-batch's forward and its replay (5 bytes an element: plan/fp8.py)
    from shardwise.plan.fp8 import cast_bytes

    layers = M7.num_layers
    per_layer = LINEARS / layers
    saved = cast_bytes(M7, FP8, 1, layers) - cast_bytes(M7, fp8, 1, layers, 16, fp8_params=True)
    assert saved == pytest.approx(layers * 5 * per_layer * (4 * 2 - 1 / 16))


def test_its_refusals_name_the_setting():
    with pytest.raises(ShardwiseError, match="zero_impl megatron"):
        Strategy.from_name("zero1", grad_reduce_in_bf16=True)  # DeepSpeed's ZeRO-1
    with pytest.raises(ShardwiseError, match="tensorwise scaling only"):
        plan_memory(M7, HW16, FP8.model_copy(update={"fp8": "delayed", "fp8_all_gather": True}),
                    Strategy.from_name("fsdp", fsdp=FSDPKnobs(reduce_every_micro_batch=True)))
    delayed = FP8.model_copy(update={"fp8": "delayed", "fp8_all_gather": True})
    assert plan_memory(M7, HW16, delayed, Strategy.from_name("zero1", zero_impl="megatron")).gpu.params \
        == pytest.approx(2 * PSI - LINEARS)  # Transformer Engine keeps fp8 weights of any recipe
    with pytest.raises(ShardwiseError, match="without --fp8"):
        TrainSpec(fp8_all_gather=True)


def test_plan_cli_takes_megatrons_precision_flags():
    base = ["--model", "llama-2-7b", "--gpu", "h100-sxm", "--gpus", "16", "--micro-batch", "1", "--seq-len", "4096",
            "--checkpointing", "full", "--json"]
    r = _plan(*base, "-s", "zero1", "-s", "fsdp", "--zero-impl", "megatron", "--grad-reduce-in-bf16",
              "--fp8", "tensorwise", "--fp8-all-gather")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {s["name"]: s for s in json.loads(r.stdout)["strategies"]}
    assert rows["zero1"]["memory"]["grads"] == 2 * PSI
    assert rows["zero1"]["memory"]["params"] == pytest.approx(2 * PSI - LINEARS)
    assert rows["zero1"]["knobs"] == {"zero_impl": "megatron", "overlap_comm": False, "grad_reduce_in_bf16": True}
    assert rows["fsdp"]["memory"]["grads"] == pytest.approx(4 * PSI / 16)  # FSDP2's own: fp32 sharded grads
    for args, said in [
        (["-s", "zero1", "--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 sets Megatron-Core's gradient buffer"),
        (["-s", "fsdp", "--fp8", "delayed", "--fp8-all-gather"], "tensorwise scaling only"),
        (["-s", "zero2", "--fp8", "tensorwise", "--fp8-all-gather"], "nor zero1 with --zero-impl megatron"),
    ]:
        bad = _plan(*base, *args)
        assert bad.returncode != 0 and said in bad.stdout + bad.stderr, (args, bad.stdout[-500:], bad.stderr[-500:])
    ok = _plan(*base, "-s", "zero1", "--zero-impl", "megatron", "--fp8", "delayed", "--fp8-all-gather")
    assert ok.returncode == 0, ok.stderr[-2000:]
