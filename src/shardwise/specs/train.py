"""TrainSpec: the training knobs that change memory, communication and time."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shardwise.config.base import Spec
from shardwise.config.fields import DTYPE_BYTES
from shardwise.config.strategy import Engine
from shardwise.errors import ShardwiseError

Precision = Literal["bf16-mixed", "fp16-mixed", "bf16-pure", "fp32"]
# AdamW with fp32/bf16 states, SGD with momentum, and AdamW with block-quantized states: 8-bit
# (torchao AdamW8bit; bitsandbytes AdamW8bit alike), 4-bit (torchao AdamW4bit), and bitsandbytes'
# PagedAdamW8bit, whose states live in CUDA unified memory that the driver pages to the host
# (plan/optimizer.py states the bytes of each).
Optimizer = Literal["adamw", "sgd", "adamw8bit", "adamw4bit", "paged_adamw8bit"]
# "auto": none where the run's plan fits, else full: decided per strategy before memory is planned
# (plan/evaluate.py `checkpointing_choice`; the trainer decides it the same way, shardwise.run.bridge).
Checkpointing = Literal["none", "full", "selective", "auto"]
# The attention kernel: HF's eager code, torch's SDPA, the flash-attn 2 package, or llm-foundry's
# Triton flash attention (MPT's `attn_impl: triton`, the default of its 2023 benchmarks; plan only).
Attention = Literal["eager", "sdpa", "flash", "triton"]
# The loss over the vocabulary (plan/loss.py): HF's standard one, the trainer's chunked one (lm_head
# and the loss fused per chunk of tokens), Liger's fused linear cross-entropy, flash-attn's in-place
# kernel, and torchtune's CEWithChunkedOutputLoss (the model's output projection in 8 chunks of the
# sequence, every chunk's logits kept, the loss upcast and computed a chunk at a time).
CrossEntropy = Literal["standard", "chunked", "fused", "inplace", "chunked-output"]
# What runs over every gradient between backward and the optimizer step (plan/timing.py): global-norm
# clipping (the trainer's: it computes the norm even with clipping off; HF Trainer's, torchtitan's,
# Megatron-LM's), torchtune's token normalisation (`training.scale_grads`: each gradient multiplied
# in place, one tensor at a time, pytorch/torchtune@1814feb recipes/full_finetune_single_device.py),
# or nothing. With the optimizer step in backward none runs: no phase has every gradient.
GradPass = Literal["clip", "scale", "none"]
# How the optimizer step runs: torch AdamW fused (one kernel, no temporaries; the trainer's
# choice on CUDA), foreach (torch's CUDA default without `fused`: one fp32 temporary the size
# of the parameters), for-loop (the CPU default: one tensor at a time), or DeepSpeed's own
# (FusedAdam / CPU Adam, chosen by the engine).
OptimizerImpl = Literal["fused", "foreach", "forloop"]
# How documents packed into one row are kept apart (shardwise.train.model.packed_attention): none (rows
# of one document, a causal kernel), flash-attn's varlen kernel, one causal SDPA call per
# document, FlexAttention with a document BlockMask, or a dense additive [B, 1, S, S] mask.
PackedAttention = Literal["none", "flash_varlen", "sdpa_varlen", "flex", "dense"]
# QLoRA's frozen base: bitsandbytes 4-bit NormalFloat with double quantization of the block scales.
BaseQuant = Literal["none", "nf4"]
# The training objective (planner-only: shardwise train runs SFT). Preference objectives as TRL
# runs them (huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8): DPO (trl/trainer/
# dpo_trainer.py) runs each example's chosen and rejected sequences as one batch ([chosen,
# rejected], `_compute_loss`) and a frozen reference's forward on the same batch; KTO
# (trl/trainer/kto_trainer.py) has the reference too but unpaired examples, one sequence each,
# plus a mismatched "KL" sequence per example that the policy and the reference run without
# gradients (`_compute_kl_logps`, `calculate_kl` unless loss_type apo_zero_unpaired); ORPO and
# SimPO (CPOTrainer with loss_type simpo) run the pair with no reference
# (trl/experimental/orpo/orpo_trainer.py, trl/experimental/cpo/cpo_trainer.py `concatenated_forward`).
Objective = Literal["sft", "dpo", "orpo", "kto", "simpo"]
# Where DPO's/KTO's reference log-probs come from: a frozen copy of the model held beside the
# policy (`model`), a pass over the data before training (`precomputed`: TRL
# precompute_ref_log_probs, `ref_model` set to None), the policy's base with its LoRA adapters
# disabled (`adapters_off`: TRL with a PEFT model and ref_model None, LLaMA-Factory's default
# under LoRA), or none (SFT, ORPO, SimPO).
Reference = Literal["model", "precomputed", "adapters_off", "none"]
# FP8 decoder linears (planner-only: shardwise train runs bf16): torchao's float8 training
# (pytorch/ao torchao/float8, what torchtitan's --float8 runs) with dynamic `tensorwise` or
# `rowwise` scaling, or Transformer Engine's `delayed` scaling (an amax history per tensor; what
# Megatron-LM --fp8-format hybrid and Composer's amp_fp8 run). All three run the forward, input-
# gradient and weight-gradient GEMMs of the decoder's linears in fp8 (E4M3; E5M2 gradients under
# TE's hybrid format); embeddings, lm_head, norms and attention stay in the compute dtype. `current`:
# Transformer Engine's Float8CurrentScaling (Megatron --fp8-recipe tensorwise; NeMo's "FP8-CS"), each
# tensor's scale from its own amax as it is cast. `mxfp8`: Transformer Engine's MXFP8BlockScaling
# (Megatron --fp8-recipe mxfp8; NeMo's "FP8-MX"), E4M3 with one E8M0 scale per 32 consecutive values,
# which only Blackwell's tensor cores (SM 10.0) run; `mxfp8-torchao`: the same format through torchao's
# MXLinear (torchao.prototype.mx_formats, torchtitan's "mx" converter).
Fp8 = Literal["none", "tensorwise", "rowwise", "delayed", "current", "mxfp8", "mxfp8-torchao"]
# Transformer Engine's recipes: their linears keep the fp8 cast of their input for backward
# (TrainSpec.linear_saved_input_bytes), where torchao's keep the high-precision input
TE_RECIPES = ("delayed", "current", "mxfp8")
PAIRED_OBJECTIVES = ("dpo", "orpo", "simpo")  # chosen and rejected sequences of each example in one batch
REFERENCE_OBJECTIVES = ("dpo", "kto")  # a reference's log-probs in the loss


def weight_decayed(name: str, ndim: int) -> bool:
    """Whether the trainer's AdamW decays a parameter (by its `named_parameters()` name and
    rank): not 1-D tensors (norms, biases) nor embeddings. The trainer's optimizer groups
    (train/engines/base.decay_groups) and the planner's ZeRO-1/2 gradient partitions
    (plan/memory.partition_holding, through ModelSpec.hf_decayed) both read it here."""
    return ndim >= 2 and "embed" not in name and "norm" not in name


# Upper bounds of the counts: past any run (the longest contexts trained are ~10M tokens, batches
# per GPU a few hundred samples), small enough that every byte and FLOP count the planner derives
# from them stays a finite float.
MAX_SEQ_LEN = 1 << 24
MAX_MICRO_BATCH = 1 << 16
MAX_GRAD_ACCUM = 1 << 20
MAX_LORA_RANK = 1 << 16


class TrainSpec(Spec):

    seq_len: int = Field(2048, gt=0, le=MAX_SEQ_LEN, description="tokens per sample")
    micro_batch: int = Field(1, gt=0, le=MAX_MICRO_BATCH, description="samples per GPU per forward")
    grad_accum: int = Field(1, gt=0, le=MAX_GRAD_ACCUM, description="micro-batches per optimizer step")
    precision: Precision = "bf16-mixed"
    optimizer: Optimizer = "adamw"
    checkpointing: Checkpointing = "none"
    attention: Attention = "sdpa"
    packed_attention: PackedAttention = Field("none", description="how packed documents are kept apart: none "
                                              "(one per row) | flash_varlen | sdpa_varlen | flex (in the kernel: "
                                              "no mask tensor) | dense (a [B, 1, S, S] mask: full S² kernel, "
                                              "the mask's bytes)")
    lora_rank: int = Field(0, ge=0, le=MAX_LORA_RANK, description="0 = full fine-tuning")
    lora_targets: tuple[str, ...] = Field(("q_proj", "k_proj", "v_proj", "o_proj"),
                                          description="adapted module names (PEFT's match), or ('all-linear',)")
    lora_modules_to_save: tuple[str, ...] = Field((), description="modules trained in full beside the adapters "
                                                  "(PEFT modules_to_save: a trainable copy of each)")
    lora_dropout: float = Field(0.0, ge=0, lt=1, allow_inf_nan=False,
                                description="dropout on each adapter's input (PEFT lora_dropout): above 0 every "
                                "adapted linear keeps the dropped input and its mask for backward")
    base_quant: BaseQuant = Field("none", description="nf4: the frozen base's decoder linears in 4-bit NF4 "
                                  "(QLoRA, bitsandbytes)")
    cross_entropy: CrossEntropy = "standard"
    ce_chunk: int = Field(1024, gt=0, le=MAX_SEQ_LEN, description="tokens per chunk for chunked cross-entropy")
    optimizer_impl: OptimizerImpl = Field("fused", description="torch AdamW kernel: fused | foreach | forloop")
    grad_pass: GradPass = Field("clip", description="over every gradient before the step: clip (global-norm "
                                "clipping), scale (torchtune's per-tensor token normalisation) or none; none runs "
                                "with the optimizer step in backward")
    optimizer_in_backward: bool = Field(False, description="each parameter's optimizer step runs in backward as "
                                        "soon as its gradient is final, which is then freed (torchtune's "
                                        "optimizer_in_bwd): no phase holds every gradient")
    activation_offload: bool = Field(False, description="the tensors saved for backward are moved to host memory "
                                     "in forward and brought back in backward (torchtune's and torchao's "
                                     "activation offloading); with checkpointing, only the layers' kept inputs")
    fused_kernels: bool = Field(False, description="elementwise work fused (torch.compile, Megatron-LM's fused "
                                "kernels): priced as one read and write per fused region, fewer launches")
    compiled_engines: tuple[Engine, ...] | None = Field(
        None, description="the engines whose decoder layers run compiled, where the trainer decides (run.compile "
        "unset): each strategy is planned with fused_kernels = its engine is one of them; None: fused_kernels "
        "holds for every engine")
    fused_norm: bool = Field(False, description="RMSNorm as one fused kernel (torchtitan fused_rmsnorm, Liger, "
                             "apex; implied by fused_kernels): it saves its input and rstd, not the fp32 chain")
    fused_mlp: bool = Field(False, description="a gated MLP's activation and product as one kernel that saves "
                            "gate and up and recomputes act(gate) in backward (Liger's LigerSiLUMulFunction, "
                            "its SwiGLU/GeGLU MLPs): 3·c·I saved a token where eager saves 4·c·I")
    expandable_segments: bool = Field(False, description="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: "
                                      "the caching allocator grows/shrinks segments (less reserved slack)")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False,
                                description="AdamW weight decay (the trainer's optimizer.weight_decay): above 0 the "
                                "parameters form two optimizer groups (`weight_decayed` and the rest), which "
                                "DeepSpeed ZeRO-1/2 partitions one by one")
    sequence_parallel: bool = Field(True, description="under TP, norms/residuals sharded over the TP ranks "
                                    "(Megatron-LM, torchtitan); no effect at tp 1")
    tp_comm_overlap: bool = Field(False, description="TP's all-gathers/reduce-scatters overlapped with the "
                                  "adjacent GEMMs (Megatron-LM --tp-comm-overlap, Transformer Engine userbuffers; "
                                  "torchtitan's async TP); no effect at tp 1")

    fp8: Fp8 = Field("none", description="planner-only: the decoder linears' GEMMs in fp8: none | tensorwise | "
                     "rowwise (torchao float8, torchtitan --float8) | delayed | current | mxfp8 (Transformer Engine's "
                     "delayed, current and MXFP8 block scaling: Megatron-LM --fp8-recipe delayed, tensorwise, mxfp8) | "
                     "mxfp8-torchao (torchao's MXLinear: torchtitan's mx converter)")
    fp8_all_gather: bool = Field(False, description="planner-only: the decoder linears' weights all-gathered in fp8, "
                                 "1 byte per element: FSDP2's (torchao enable_fsdp_float8_all_gather; tensorwise "
                                 "only), held so unsharded, cast on each shard before the gather; Megatron-Core's "
                                 "distributed optimizer's (zero_impl megatron: --fp8-param-gather), where the module "
                                 "keeps them in fp8 and the optimizer casts its updated shard")
    objective: Objective = Field("sft", description="planner-only (shardwise train runs sft): sft | dpo | orpo | "
                                 "kto | simpo; dpo, orpo and simpo run each example's chosen and rejected sequences "
                                 "in one batch (2 × micro_batch sequences of seq_len tokens per forward)")
    reference: Reference = Field("none", description="dpo/kto: where the reference log-probs come from: model (a "
                                 "frozen copy held beside the policy), precomputed (a pass before training), "
                                 "adapters_off (LoRA: the base with adapters disabled); none for sft, orpo, simpo. "
                                 "Unset: model, or adapters_off under LoRA")

    @model_validator(mode="before")
    @classmethod
    def _reference_default(cls, data):
        """An objective with a reference gets TRL's default where none is given: the base with the
        adapters disabled under LoRA (DPOTrainer with a PEFT model and ref_model None), else a frozen
        copy of the model (DPOTrainer creates one from the policy's path)."""
        if isinstance(data, dict) and data.get("reference") is None:
            data = dict(data)
            if data.get("objective") in REFERENCE_OBJECTIVES:
                data["reference"] = "adapters_off" if data.get("lora_rank") else "model"
            else:
                data["reference"] = "none"
        return data

    @model_validator(mode="after")
    def _reference_fits_objective(self) -> TrainSpec:
        if self.objective in REFERENCE_OBJECTIVES and self.reference == "none":
            raise ShardwiseError(
                f"--reference none with --objective {self.objective}: {self.objective} needs reference log-probs "
                "(TRL's DPOTrainer/KTOTrainer): model, precomputed, or adapters-off under LoRA")
        if self.objective not in REFERENCE_OBJECTIVES and self.reference != "none":
            raise ShardwiseError(
                f"--reference {self.reference.replace('_', '-')} with --objective {self.objective}: {self.objective} "
                "has no reference model (orpo and simpo are reference-free: TRL's ORPOTrainer and CPOTrainer; sft "
                "has none): drop --reference")
        if self.reference == "adapters_off" and not self.lora_rank:
            raise ShardwiseError(
                "--reference adapters-off needs --lora-rank: the reference is the base with the LoRA adapters "
                "disabled; full fine-tuning has no adapters to disable (use --reference model or precomputed)")
        if self.lora_dropout and not self.lora_rank:
            raise ShardwiseError(f"--lora-dropout {self.lora_dropout} needs --lora-rank: the dropout is on the LoRA "
                                 "adapters' input; full fine-tuning has none")
        return self

    @model_validator(mode="after")
    def _fp8_runs(self) -> TrainSpec:
        if self.fp8 != "none" and self.compute_dtype != "bf16":
            raise ShardwiseError(f"--fp8 {self.fp8} with --precision {self.precision}: fp8 training runs its linears' "
                                 "GEMMs in fp8 and the rest in bf16 (torchao float8, Transformer Engine): use "
                                 "bf16-mixed or bf16-pure")
        if self.fp8 != "none" and (self.lora_rank or self.base_quant != "none"):
            raise ShardwiseError(f"--fp8 {self.fp8} with LoRA: fp8 training is planned for full fine-tuning (torchao's "
                                 "Float8Linear and Transformer Engine train every weight of the linears they swap)")
        if self.fp8_all_gather and self.fp8 == "none":
            raise ShardwiseError("--fp8-all-gather without --fp8: it gathers the fp8 linears' weights in fp8 "
                                 "(give --fp8 tensorwise for FSDP2, or the recipe Megatron runs)")
        return self

    @property
    def grad_pass_run(self) -> GradPass:
        """The pass over every gradient the step runs: `grad_pass`, none with the optimizer step
        in backward (no phase has every gradient)."""
        return "none" if self.optimizer_in_backward else self.grad_pass

    @property
    def loss_after_forward(self) -> bool:
        """The loss runs on what the model's forward returned, after it: standard (the trainer's
        `token_loss_sum` on the logits, torchtitan's loss), inplace (Composer's loss method) and
        chunked-output (torchtune's loss on the output chunks). chunked (the trainer's LossHead)
        and fused (Liger's patched forward) run inside it, lm_head's weight in use."""
        return self.cross_entropy in ("standard", "inplace", "chunked-output")

    @property
    def sequences_per_example(self) -> int:
        """Sequences one example puts in the trained forward: the chosen and the rejected one for
        the paired objectives, one otherwise."""
        return 2 if self.objective in PAIRED_OBJECTIVES else 1

    @property
    def forward_only_share(self) -> float:
        """Sequences run forward without gradients per trained sequence: DPO's reference forward
        on the same [chosen, rejected] batch (1); KTO's reference on each example's sequence and
        its KL sequence, and the policy's own no-grad forward on the KL sequence (3; 1 with the
        reference precomputed). None where the reference is precomputed or absent."""
        ref = self.reference in ("model", "adapters_off")
        if self.objective == "dpo":
            return 1.0 if ref else 0.0
        if self.objective == "kto":
            return 1.0 + (2.0 if ref else 0.0)
        return 0.0

    @property
    def holds_reference(self) -> bool:
        """A frozen reference copy of the model is held in memory (reference `model`)."""
        return self.reference == "model"

    def as_sequences(self) -> TrainSpec:
        """This spec as the engines see one forward: `micro_batch` counting sequences (2 per
        example for the paired objectives), no objective left to apply. The planner's activations,
        logits, compute and TP/PP traffic read it; the reference's own terms read the spec itself."""
        if self.objective == "sft":
            return self
        return self.model_copy(update={"micro_batch": self.micro_batch * self.sequences_per_example,
                                       "objective": "sft", "reference": "none"})

    @model_validator(mode="after")
    def _in_backward_steps_once(self) -> TrainSpec:
        if self.optimizer_in_backward and self.grad_accum > 1:
            raise ShardwiseError(
                "the optimizer step in backward (--optimizer-in-backward; YAML optimizer.in_backward) updates in "
                f"each micro-batch's backward, so it cannot accumulate: gradient accumulation (--grad-accum; YAML "
                f"run.grad_accum) must be 1, not {self.grad_accum} (raise the micro-batch instead)")
        if self.optimizer_in_backward and self.compute_dtype == "fp16":
            raise ShardwiseError("the optimizer step in backward (--optimizer-in-backward; YAML optimizer.in_backward) "
                                 "cannot run under fp16: its loss scaling unscales every gradient before any update; "
                                 "use bf16-mixed (or fp32)")
        return self

    def for_engine(self, engine: str) -> TrainSpec:
        """This spec as `engine` runs it: fused_kernels decided by `compiled_engines` where set."""
        if self.compiled_engines is None:
            return self
        return self.model_copy(update={"fused_kernels": engine in self.compiled_engines, "compiled_engines": None})

    @property
    def norm_fused(self) -> bool:
        """Each RMSNorm runs as one fused kernel: asked for (`fused_norm`), or implied by fused
        elementwise work (torch.compile fuses the norm's chain; Megatron-LM's fused kernels).
        activations.py (what it saves) and kernels.py (the bytes it moves) read it here."""
        return self.fused_norm or self.fused_kernels

    @property
    def compute_dtype(self) -> str:
        return {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16-pure": "bf16", "fp32": "fp32"}[self.precision]

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def linear_saved_input_bytes(self) -> float | None:
        """Bytes per element a decoder linear keeps of its input for backward where that is not
        the compute dtype: Transformer Engine's recipes keep the fp8 cast their weight-gradient GEMM
        reads (module/linear.py `saved_inputmat`, layernorm_linear.py `ln_out_to_save`: the rank's
        own sequence shard under sequence parallelism; NVIDIA/TransformerEngine@d0067d0), one byte,
        and under MXFP8 its columnwise copy with an E8M0 scale per 32 values (1 + 1/32). torchao's
        keep the high-precision input (float8_linear.py), as bf16 linears do: None."""
        if self.fp8 not in TE_RECIPES:
            return None
        return 1 + 1 / 32 if self.fp8 == "mxfp8" else 1.0

    @property
    def master_dtype(self) -> str:
        """The dtype of the weights the optimizer updates, their gradients and its state: fp32
        (the mixed precisions keep fp32 master weights), bf16 under bf16-pure."""
        return "bf16" if self.precision == "bf16-pure" else "fp32"

    @property
    def master_bytes(self) -> int:
        return DTYPE_BYTES[self.master_dtype]

    @property
    def mixed_precision(self) -> bool:
        """16-bit compute over fp32 weights (bf16-mixed, fp16-mixed): the engines keep fp32
        parameters and cast for compute (FSDP2's MixedPrecisionPolicy, DDP's autocast)."""
        return self.precision in ("bf16-mixed", "fp16-mixed")

    def autocasts(self, engine: str) -> bool:
        """Whether `engine` runs an fp32 module under torch.autocast: DDP in mixed precision,
        except a LoRA base, which is already stored in the compute dtype (nothing to cast)."""
        return engine == "ddp" and self.mixed_precision and not self.lora_rank

    @property
    def layer_passes(self) -> int:
        """Times each decoder layer runs per micro-batch: forward and backward, plus its
        recompute inside backward under full checkpointing."""
        return 3 if self.checkpointing == "full" else 2

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch
