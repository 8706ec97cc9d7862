"""Context parallelism: each sequence split over `cp` GPUs of the data-parallel group. Pure functions.

What one rank of a cp group does, as the planner prices it:

- Every layer but attention sees its own seq/cp tokens (`local_train`): the GEMMs, the norms,
  the MLP, the loss and the tensors they save for backward are those of a seq/cp sequence.
- Attention: each rank's queries against the keys before them in the whole sequence
  (`key_len`: timing prices the attention kernels at the whole sequence's key length, 1/cp of
  its causal score FLOPs per rank). Balanced where the sequence is cut into 2·cp chunks and rank
  r takes chunks r and 2·cp−1−r (torch 2.13 `_context_parallel/_load_balancer.py`
  `_HeadTailLoadBalancer`; Megatron-Core `get_batch_on_this_cp_rank`; ring-flash-attn's zigzag),
  so the sequence must split into 2·cp equal chunks. Cut into cp consecutive chunks
  (`cp_load_balance` off: axolotl's batch_ring and varlen_llama3 slice `chunk(cp)[rank]`,
  axolotl-ai-cloud/axolotl src/axolotl/utils/ctx_managers/sequence_parallel.py), the last rank's
  queries see the whole sequence: its attention is (2·cp − 1)/cp of the mean (`imbalance`), and
  the step waits for it. Ulysses attends over whole sequences (a head split): balanced.
- Keys and values move between the cp ranks (`exchange_bytes`), per layer and pass, by scheme
  (`Strategy.cp_scheme`):
  - "torch": torch's `context_parallel` (torchtitan, accelerate's ParallelismConfig cp_size).
    Over SDPA (rows of one document), the default rotate method ALL_GATHER (torch 2.13
    `_ContextParallelOptions.rotate_method`): forward all-gathers each layer's local K and V
    once (`_AllGatherRotater`); backward gathers them again and passes the K/V gradients round
    the ring with an all-to-all permute at every one of its cp iterations, in fp32
    (`convert_to_f32` True: `accum_dtype = torch.float32`, `_templated_ring_attention_backward`).
    K and V are as SDPA receives them: expanded to every query head (torchtitan's Llama repeats
    the K/V heads before SDPA, `repeat_kv`, pytorch/torchtitan@9dec370
    torchtitan/models/llama/model.py). Over FlexAttention (packed documents, a document
    BlockMask), K and V are all-gathered whole before the kernel and their gradients
    reduce-scattered after it, in the compute dtype and without the head expansion
    (`_cp_custom_ops.flex_cp_allgather` and its backward); the gathered K/V are the kernel's
    inputs, saved for its backward (`saved_extra`).
  - "ring": a p2p ring of the grouped K/V (Megatron-Core with Transformer Engine's
    `AttnFuncWithCPAndKVP2P`; ring-flash-attn's ring and zigzag functions, axolotl's batch_ring):
    cp−1 sends of the local K/V in forward, and cp−1 of K/V and of their gradients in backward,
    in the compute dtype (assumed: the dtype TE passes dK/dV in is not read here).
  - "allgather": the Llama 3 paper's (Dubey et al. 2024 §3.3.2): the grouped K/V all-gathered
    before attention and their gradients reduce-scattered after it; gathered again in backward
    rather than saved (ring-flash-attn `llama3_flash_attn_varlen_func`, axolotl's varlen_llama3
    under sample packing), head group by head group (axolotl's heads_k_stride 1), each gather
    overlapping the previous group's attention.
  - "ulysses": DeepSpeed Ulysses (Jacobs et al. 2023, arXiv:2309.14509 §3.1): an all-to-all of
    q, k and v before attention and of its output after, each sending (cp−1)/cp of the local
    tensor; the same four in backward. Attention then runs on whole sequences over heads/cp.
- The exchange overlaps attention (`hidden_share`): "ring" sends the next chunk while the current
  one is computed, hiding behind (cp−1)/cp of the attention time; "torch" over SDPA all-gathers
  once, behind the first (local) chunk's 1/cp, and over Flex waits for its gather (0);
  "allgather" hides all but its first head group's; "ulysses" all-to-alls wait for the attention
  and it for them (0).
- Memory: one layer's exchange buffers in backward (`backward_buffers`) beside the gradient
  buffers; the forward's are freed layer by layer before the end of forward's peak.
- Model states are sharded and reduced over the data-parallel group including the cp ranks
  (specs/layout.py), as any data-parallel state is.
"""

from __future__ import annotations

from shardwise.specs.model import ModelSpec
from shardwise.specs.train import TrainSpec

FP32_BYTES = 4


def _path(train: TrainSpec, scheme: str) -> str:
    """The exchange as run: torch's CP over FlexAttention ("flex") or over SDPA ("torch"), else the scheme."""
    return "flex" if scheme == "torch" and train.packed_attention == "flex" else scheme


def refusal(model: ModelSpec, train: TrainSpec, cp: int, scheme: str, tp: int = 1, balanced: bool = True) -> str | None:
    """Why `train` cannot run with context parallelism `cp` under `scheme` (None: it can)."""
    if cp == 1:
        return None
    if train.attention == "eager":
        return ("context parallelism splits SDPA or flash-attn kernels over the sequence; eager attention "
                "materialises the whole score matrix (use sdpa or flash)")
    chunks = 2 * cp if balanced and scheme != "ulysses" else cp
    if train.seq_len % chunks:
        return (f"seq_len {train.seq_len} does not split into {chunks} equal chunks (cp {cp}"
                + (": each rank takes 2 chunks, load-balanced for causal attention)" if chunks > cp else ")"))
    if train.packed_attention == "dense":
        return "a dense [S, S] mask of packed documents does not split over the sequence"
    if scheme == "torch" and train.packed_attention not in ("none", "flex"):
        return (f"torch's context_parallel splits SDPA on whole rows or FlexAttention with a document mask, not "
                f"{train.packed_attention}; packed_attention flex, or cp_impl allgather (ring-flash-attn's "
                "varlen) or ulysses")
    if scheme == "ulysses" and model.num_heads % (cp * tp):
        return f"ulysses splits the {model.num_heads} attention heads over cp {cp} × tp {tp} ranks: it must divide them"
    return None


def local_train(train: TrainSpec, cp: int) -> TrainSpec:
    """`train` as one cp rank's layers see it: seq/cp tokens of each sequence."""
    if cp == 1:
        return train
    return train.model_copy(update={"seq_len": train.seq_len // cp})


def key_len(train: TrainSpec, cp: int) -> int:
    """The keys each query attends over: the whole sequence (`train` as `local_train` gives it)."""
    return train.seq_len * cp


def imbalance(cp: int, scheme: str, balanced: bool) -> float:
    """The busiest rank's attention work over the mean: 1 when balanced, (2·cp − 1)/cp for
    consecutive chunks (the last rank's queries attend over all cp chunks, the mean over (cp+1)/2)."""
    if cp == 1 or balanced or scheme == "ulysses":
        return 1.0
    return (2 * cp - 1) / cp


def _kv_width(model: ModelSpec, train: TrainSpec, scheme: str, tp: int) -> tuple[float, float]:
    """(K, V) elements per token one rank exchanges: expanded to the query heads on torch's SDPA ring."""
    if _path(train, scheme) == "torch":
        return model.q_dim / tp, model.o_dim / tp
    return model.kv_dim / tp, model.v_dim / tp


def exchange_bytes(model: ModelSpec, train: TrainSpec, cp: int, scheme: str, tp: int = 1) -> tuple[float, float]:
    """(forward, backward) bytes one rank receives per decoder layer and micro-batch (`train` as
    `local_train` gives it). A recomputed forward (full checkpointing) exchanges the forward's again."""
    if cp == 1:
        return 0.0, 0.0
    c, tokens = train.compute_bytes, train.tokens_per_micro_batch
    if scheme == "ulysses":
        width = (model.q_dim + model.kv_dim + model.v_dim + model.o_dim) / tp
        each = (cp - 1) / cp * tokens * width * c
        return each, each
    k, v = _kv_width(model, train, scheme, tp)
    kv = (cp - 1) * tokens * (k + v) * c  # the other ranks' K/V (or their gradients), in the compute dtype
    path = _path(train, scheme)
    if path == "torch":
        return kv, kv + cp * tokens * (k + v) * FP32_BYTES
    if path == "flex":  # gathered once and saved: the backward reduce-scatters the gradients only
        return kv, kv
    return kv, 2 * kv  # ring: K/V and their gradients; allgather: gathered again, gradients reduce-scattered


def exchanges_per_layer(model: ModelSpec, train: TrainSpec, cp: int, scheme: str) -> tuple[int, int]:
    """(forward, backward) collective launches per layer and micro-batch."""
    if cp == 1:
        return 0, 0
    path = _path(train, scheme)
    if path == "ulysses":
        return 4, 4
    if path == "flex":  # K and V apart
        return 2, 2
    if path == "allgather":  # one gather per K/V head (heads_k_stride 1), and a reduce-scatter each in backward
        return model.num_kv_heads, 2 * model.num_kv_heads
    if path == "torch":
        return 1, 1 + cp
    return cp - 1, 2 * (cp - 1)


def hidden_share(model: ModelSpec, train: TrainSpec, cp: int, scheme: str) -> float:
    """Of the attention time, what the exchange overlaps."""
    if cp == 1:
        return 0.0
    return {"torch": 1 / cp, "ring": (cp - 1) / cp, "allgather": 1 - 1 / model.num_kv_heads,
            "flex": 0.0, "ulysses": 0.0}[_path(train, scheme)]


def backward_buffers(model: ModelSpec, train: TrainSpec, cp: int, scheme: str, tp: int = 1) -> float:
    """One layer's exchange buffers during its attention backward (`train` as `local_train` gives it).
    torch over SDPA: the gathered K/V, and fp32 dK/dV, their ring copy and dQ; over Flex and
    allgather: the whole sequence's dK/dV before their reduce-scatter (allgather: and K/V
    gathered again); ring: the K/V in flight and the dK/dV being passed (two chunks each);
    ulysses: the all-to-alls' outputs of q, k, v and o."""
    if cp == 1:
        return 0.0
    c, tokens = train.compute_bytes, train.tokens_per_micro_batch
    if scheme == "ulysses":
        return tokens * (model.q_dim + model.kv_dim + model.v_dim + model.o_dim) / tp * c
    k, v = _kv_width(model, train, scheme, tp)
    kv = tokens * (k + v)
    path = _path(train, scheme)
    if path == "torch":
        return cp * kv * c + 2 * kv * FP32_BYTES + tokens * model.q_dim / tp * FP32_BYTES
    if path == "flex":
        return cp * kv * c
    if path == "allgather":
        return 2 * cp * kv * c
    return 4 * kv * c


def saved_extra(model: ModelSpec, train: TrainSpec, cp: int, scheme: str, tp: int = 1) -> float:
    """Bytes a layer saves for backward beyond its local q, k, v (`train` as `local_train` gives
    it): torch's Flex path keeps the gathered K/V of the other cp − 1 ranks."""
    if cp == 1 or _path(train, scheme) != "flex":
        return 0.0
    k, v = _kv_width(model, train, scheme, tp)
    return (cp - 1) * train.tokens_per_micro_batch * (k + v) * train.compute_bytes
