"""FP8 linears (TrainSpec.fp8, planner-only): what they change against the same run in bf16.

The decoder layers' linears run their three GEMMs (forward, input gradient, weight gradient) at
the GPU's FP8 peak (GPUSpec.fp8_flops) with the GEMM efficiency of its bf16 kernels, an
assumption: no FP8 run here measured its own (docs/accuracy.md lists it). Embeddings, lm_head,
norms and attention stay in bf16: torchtitan's float8 converter skips the output projection
(torchtitan/components/quantization/float8.py `filter_fqns` with "output"), Transformer Engine
swaps only the layers' Linear / LayerNormLinear modules.

Around each fp8 GEMM its operands are cast, memory-bound work per element (`CASTS`):

- torchao dynamic scaling, tensorwise or rowwise (pytorch/ao torchao/float8/float8_linear.py
  `matmul_with_hp_or_float8_args`): forward, the input and the weight each read for their amax
  (2 bytes) then read and written as fp8 (3): 5 bytes an element; backward, the output gradient
  cast twice (for the input-gradient GEMM and, in the other layout, for the weight gradient: 10),
  and the saved high-precision input and weight cast again (5 each). The saved tensors are the
  bf16 ones, so activation memory is unchanged.
- Transformer Engine delayed scaling (transformer_engine/pytorch/module/linear.py with a
  DelayedScaling recipe): the scale comes from the amax history, so a cast is one fused
  cast-transpose (read 2, write fp8 and its transpose: 4) of the input, of the output gradient,
  and of the weight once per optimizer step (`is_first_microbatch` caches it); the fp8 input is
  what backward keeps.
- Transformer Engine current scaling (`current`: recipe Float8CurrentScaling, Megatron's
  --fp8-recipe tensorwise): the amax of each tensor read first (2 bytes), then the fused
  cast-transpose (read 2, write fp8 and its transpose: 4): 6 bytes an element of the input and of
  the output gradient; the weight once per optimizer step, cached as delayed scaling's; backward
  reuses the saved fp8 input.
- torchao's MXLinear (`mxfp8-torchao`: torchao/prototype/mx_formats/mx_linear.py `mx_mm`, pytorch/ao
  before ac6f6411b; torchtitan's "mx" converter) casts each operand along one dimension a kernel
  (2 + 1 + 1/32 bytes an element): forward the input and the weight, backward the output gradient
  along both dimensions and the saved bf16 input and weight again along the other; it saves the
  bf16 input and weight (`save_for_backward(input_hp, weight_hp)`), as torchao's float8 does.
- Transformer Engine MXFP8 block scaling (`mxfp8`: recipe MXFP8BlockScaling, Blackwell only): one
  kernel reads a tensor once and writes it quantized along both dimensions with an E8M0 scale per
  32 values (NVIDIA/TransformerEngine transformer_engine/common/util/cast_kernels.cuh
  `cast_mxfp8_2D_kernel`, ROWWISE_SCALING and COLWISE_SCALING): 2 + 1 + 1 + 2/32 bytes an element,
  for the input, the output gradient, and the weight once per step (cached across micro-batches
  as delayed scaling's); backward reuses the columnwise copies it saved.

With FSDP2's float8 all-gather (`fp8_all_gather`: torchao `enable_fsdp_float8_all_gather`,
tensorwise) each rank casts its own shard of a weight before the all-gather, so the forward cast
of the weights is 1/dp of theirs, and the gathered weights are fp8: one byte an element moved and
held where bf16 has two.
"""

from __future__ import annotations

from shardwise.plan.kernels import layer_gemms
from shardwise.plan.pipeline import PipelineRank
from shardwise.specs.hardware import GPUSpec
from shardwise.specs.model import ModelSpec
from shardwise.specs.train import TrainSpec

# bytes an element moves in the casts of one micro-batch, per recipe: (forward input, forward
# weight, backward output-gradient, backward input, backward weight); derived from the kernels
# named in the module's docstring, not measured
MX = 2 + 1 + 1 + 2 / 32  # read bf16, write both fp8 orientations and their E8M0 block scales
MX1 = 2 + 1 + 1 / 32  # read bf16, write one orientation and its scales (torchao: a kernel per dimension)
CASTS = {"tensorwise": (5.0, 5.0, 10.0, 5.0, 5.0), "rowwise": (5.0, 5.0, 10.0, 5.0, 5.0),
         "delayed": (4.0, 4.0, 4.0, 0.0, 0.0), "current": (6.0, 6.0, 6.0, 0.0, 0.0), "mxfp8": (MX, MX, MX, 0.0, 0.0),
         "mxfp8-torchao": (MX1, MX1, 2 * MX1, MX1, MX1)}
# recipes whose weights are quantized once per optimizer step (cached across micro-batches)
WEIGHTS_ONCE = ("delayed", "current", "mxfp8")
# GPU families whose tensor cores run MXFP8 (SM 10.0: catalog/hardware.yaml's B200 and GB200)
MXFP8_FAMILIES = ("blackwell",)
MX_RECIPES = ("mxfp8", "mxfp8-torchao")
FP8_BYTES = 1


def cast_bytes(model: ModelSpec, train: TrainSpec, tp: int, layers: float, dp_shard: int = 1, ep: int = 1,
               etp: int | None = None, *, fp8_params: bool = False) -> float:
    """Bytes the fp8 casts move on one GPU per optimizer step, over its `layers` decoder layers
    (its TP shard of each linear; under expert parallelism its num_experts/ep experts over `etp`
    ranks, with the tokens routed to them: kernels.layer_gemms): forward casts again in a
    checkpointed layer's replay; the weights' forward cast once per step under delayed scaling,
    and on the rank's 1/`dp_shard` shard under the float8 all-gather. `fp8_params`: the module
    keeps the weights in fp8 (Megatron-Core's --fp8-param-gather), cast once a step by the
    optimizer as it writes its updated shard."""
    if train.fp8 == "none":
        return 0.0
    fwd_in, fwd_w, bwd_g, bwd_in, bwd_w = CASTS[train.fp8]
    tokens, k = train.micro_batch * train.seq_len, train.grad_accum
    shapes = layer_gemms(model, tp, ep, etp)
    inputs = sum(tokens * share * kk for kk, _, share in shapes)
    outputs = sum(tokens * share * nn for _, nn, share in shapes)
    weights = sum(kk * nn for kk, nn, _ in shapes)
    replay = 1.0 if train.checkpointing == "full" else 0.0
    w_fwd = fwd_w * weights / (dp_shard if train.fp8_all_gather else 1)
    per_micro = (fwd_in * inputs) * (1 + replay) + bwd_g * outputs + bwd_in * inputs + bwd_w * weights
    weight_casts = w_fwd if train.fp8 in WEIGHTS_ONCE or fp8_params else k * w_fwd * (1 + replay)
    return layers * (k * per_micro + weight_casts)


def recipe_refusal(gpu: GPUSpec, train: TrainSpec) -> str | None:
    """Why `gpu` cannot run `train`'s fp8 recipe, or None: FP8 tensor cores for any (the catalog's
    fp8_tflops), Blackwell's block-scaled MMA for MXFP8."""
    if train.fp8 in MX_RECIPES and gpu.family not in MXFP8_FAMILIES:
        return (f"--fp8 {train.fp8} on {gpu.name}: MXFP8 block scaling runs on Blackwell tensor cores (SM 10.0: b200, "
                "gb200) only; use tensorwise, rowwise, delayed or current")
    return None


def all_gather_refusal(strategy, train: TrainSpec) -> str | None:
    """Why `strategy` does not gather `train`'s fp8 weights in fp8 (`fp8_all_gather`), or None:
    torchao's FSDP2 float8 all-gather runs tensorwise scaling only
    (Float8LinearConfig.enable_fsdp_float8_all_gather); Megatron-Core's --fp8-param-gather keeps
    Transformer Engine's fp8 weights of any recipe (delayed, current scaling, MXFP8). Other
    engines gather nothing in fp8: the flag changes nothing for their rows."""
    if not train.fp8_all_gather:
        return None
    if strategy.engine == "fsdp2" and train.fp8 != "tensorwise":
        return (f"--fp8-all-gather with --fp8 {train.fp8} and {strategy.name}: torchao gathers fp8 weights with "
                "tensorwise scaling only (Float8LinearConfig.enable_fsdp_float8_all_gather): use --fp8 tensorwise")
    return None


def gathered_linear_bytes_saved(c: int, train: TrainSpec) -> float:
    """Bytes fewer per decoder-linear parameter that the fp8 all-gather moves and holds (fp8
    instead of the compute dtype): FSDP2's unsharded weights, Megatron-Core's module weights."""
    return float(c - FP8_BYTES) if train.fp8_all_gather else 0.0


def linear_share(model: ModelSpec, rank: PipelineRank, tp: int) -> tuple[float, float]:
    """(the decoder linears' weights on pipeline rank `rank` and TP rank, those of its largest
    layer): what FSDP2's float8 all-gather moves and holds in fp8."""
    from shardwise.plan.lora import linear_weight_params

    total = linear_weight_params(model, tp, rank=rank)
    per_layer = total / max(len(rank.layers), 1)
    return total, per_layer
