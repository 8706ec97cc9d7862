"""Low-bit AdamW states (`optimizer.name`: adamw8bit, adamw4bit, paged_adamw8bit) for the DDP and
FSDP2 engines: the optimizer, its states created up front, and their checkpoint form.

- adamw8bit / adamw4bit: torchao's `AdamW8bit` / `AdamW4bit` (torchao/optim/adam.py). Each moment
  of a quantized parameter is a tensor subclass (`OptimState8bit`, `OptimState4bit`) holding
  uint8 `codes` (one per element; 4-bit: two per byte, flattened) and one fp32 `scale` per block
  of the flattened tensor (256 elements; 4-bit: 128), with a constant lookup table (`qmap`) that
  depends only on the moment (exp_avg signed, exp_avg_sq not). Under FSDP2 the subclass is the
  local tensor of a DTensor shaped like the parameter.
- paged_adamw8bit: bitsandbytes' `PagedAdamW8bit` (CUDA; plain tensors only, so DDP): uint8
  `state1`/`state2` shaped like the parameter and one fp32 `absmax1`/`absmax2` per 256 elements.

Both keep a tensor in fp32 where it is small (under 4096 elements). Which of a parameter's
states are quantized is decided here, once, when the optimizer is built (`init_states`):
torchao's own rule (at least 4096 elements, a whole number of blocks) on every rank's shard, and
the shards tile the flattened tensor in equal parts (FSDP2's Shard(0) with a row count the shard
group divides). Quantized states are then blocks of the *whole* flattened tensor, whatever the
world size, which is what the checkpoint stores. torchao decides per shard at its first step; a
tensor with rows the ranks do not divide evenly stays fp32 here (GPT-2's 50,257-row embedding on
2 ranks), where torchao might quantize one rank's shard and not the other's.

The checkpoint holds plain tensors only (nothing in it is unpickled: shardwise.train.checkpoint.
index). Under the canonical names (shardwise.train.checkpoint.sharded), per trained parameter and
moment `m` (exp_avg, exp_avg_sq):

- `optim.<m>.<fqn>`: fp32, the parameter's shape, where the state is kept in full precision;
- `optim.<m>_codes.<fqn>` (uint8: the parameter's shape; adamw4bit: flat, two codes per byte) and
  `optim.<m>_scale.<fqn>` (fp32, one per block, flat) where it is quantized.

The lookup table is not stored (a constant of the library and the moment). A run resumed on the
same quantization layout reads codes and scales into its states in place: bit-exact. Where the
layout changed with the world size (a shard fell under 4096 elements, or rows stopped dividing),
a saved fp32 state is quantized by torchao's own copy, and saved codes are dequantized (exact)
into the fp32 state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from shardwise.errors import ShardwiseError

LOW_BIT = ("adamw8bit", "adamw4bit", "paged_adamw8bit")
TORCHAO = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}
MOMENTS = ("exp_avg", "exp_avg_sq")
MIN_QUANTIZED = 4096  # torchao adam.py `_new_buffer`, bitsandbytes `min_8bit_size`
BNB_KEYS = {"exp_avg": ("state1", "absmax1"), "exp_avg_sq": ("state2", "absmax2")}


def is_low_bit(name: str) -> bool:
    return name in LOW_BIT


def optimizer_class(name: str, source: str = "<config>") -> type[torch.optim.Optimizer]:
    """The library's optimizer class for `optimizer.name`, imported; a ShardwiseError naming the
    field and the install command where the library is missing or does not import."""
    if name == "paged_adamw8bit":
        try:
            from bitsandbytes.optim import PagedAdamW8bit
        except ImportError as e:
            raise ShardwiseError(f"{source}: optimizer.name 'paged_adamw8bit' runs bitsandbytes' PagedAdamW8bit, "
                                 f"and bitsandbytes does not import here ({e}): pip install bitsandbytes") from None
        return PagedAdamW8bit
    try:
        import torchao.optim
    except ImportError as e:
        raise ShardwiseError(f"{source}: optimizer.name {name!r} runs torchao's {TORCHAO[name]}, and torchao does not "
                             f"import here ({e}): pip install torchao (shardwise's extra: pip install "
                             "'shardwise[lowbit]'), or use optimizer.name: adamw") from None
    return getattr(torchao.optim, TORCHAO[name])


def build(name: str, groups: list[dict[str, Any]], *, lr: float, betas: tuple[float, float], eps: float,
          weight_decay: float, source: str = "<config>") -> torch.optim.Optimizer:
    """The low-bit AdamW over `groups` (each group's own weight decay kept), its states created."""
    cls = optimizer_class(name, source)
    if name in TORCHAO:
        cls = _tagged(cls)
    opt = cls(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    init_states(opt)
    return opt


_TAGGED: dict[type, type] = {}


def _tagged(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """torchao's AdamW whose compiled step is cached under its own tag (torch.compiler.config.
    cache_key_tag, part of every compile cache's key). torch's on-disk AOT autograd cache keys a
    DTensor input by its spec (shape, placements, dtype: DTensor's `_stable_hash_for_caching`),
    not by the class of its local tensor, so under FSDP2 a state DTensor holding `OptimState8bit`
    and one holding `OptimState4bit` of the same parameter got the same key: a run with adamw4bit
    after one with adamw8bit on the same machine loaded the 8-bit step's compiled graph and failed
    in it (`assert_size_stride`), and the other way round. With the class in the tag each keeps
    its own entries, and a later run of the same optimizer still starts from the cache."""
    if cls not in _TAGGED:
        tag = f"shardwise-low-bit:{cls.__module__}.{cls.__qualname__}"

        def step(self: Any, closure: Any = None) -> Any:
            with torch.compiler.config.patch(cache_key_tag=f"{torch.compiler.config.cache_key_tag}|{tag}"):
                return super(tagged, self).step(closure)

        doc = f"torchao's {cls.__name__}, its step compiled under the cache tag {tag!r} (low_bit._tagged)."
        tagged = type(cls.__name__, (cls,), {"step": step, "__module__": cls.__module__, "__doc__": doc})
        _TAGGED[cls] = tagged
    return _TAGGED[cls]


def _is_bnb(opt: torch.optim.Optimizer) -> bool:
    return type(opt).__module__.startswith("bitsandbytes")


def _even_shards(p: torch.Tensor) -> int | None:
    """Into how many equal, contiguous parts of its flattened self `p` is split across ranks (1:
    a plain tensor or a replicated DTensor), or None where the parts are not equal and contiguous
    (rows the shard group does not divide, a shard on another dimension)."""
    if not isinstance(p, DTensor):
        return 1
    parts = 1
    for size, placement in zip(p.device_mesh.shape, p.placements, strict=True):
        if type(placement) is Shard and placement.dim == 0:
            parts *= size
        elif not isinstance(placement, Replicate):
            return None
    return parts if p.ndim and p.shape[0] % parts == 0 else None


def quantizes(p: torch.Tensor, block: int) -> bool:
    """Whether the states of `p` are quantized (the module docstring's rule)."""
    parts = _even_shards(p)
    if parts is None:
        return False
    n = p.numel() // parts
    return n >= MIN_QUANTIZED and n % block == 0


def _torchao_zeros(opt: Any, p: torch.Tensor, signed: bool) -> torch.Tensor:
    """A zero state for `p`, as torchao's `_new_buffer` makes it (the subclass for the local
    shard, wrapped in a DTensor like `p`), quantized or not by `quantizes`."""
    local = p.to_local() if isinstance(p, DTensor) else p
    if quantizes(p, opt.block_size):
        out = opt._subclass_zeros(local, signed, opt.block_size)
    else:
        out = torch.zeros_like(local)
    if isinstance(p, DTensor):
        out = DTensor.from_local(out, device_mesh=p.device_mesh, placements=p.placements, run_check=False,
                                 shape=p.shape, stride=p.stride())
    return out.to(p.device)  # CPU-offloaded shards: from_local moved it to the mesh's device


def init_states(opt: torch.optim.Optimizer) -> None:
    """Every parameter's state, created now (step 0, zero moments) where it has none: the states
    a checkpoint loads into, and the quantization layout fixed before the first step (which
    creates none where they exist)."""
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            st = opt.state[p]
            if st:
                continue
            if _is_bnb(opt):
                opt.init_state(group, p, gi, pi)  # type: ignore[attr-defined]
            else:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = _torchao_zeros(opt, p, signed=True)
                st["exp_avg_sq"] = _torchao_zeros(opt, p, signed=False)


def set_lr(group: dict[str, Any], lr: float) -> None:
    """torchao keeps each group's lr as a tensor (an input of its compiled step) and refuses a float."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


# --- one moment's tensors ---------------------------------------------------------------------


@dataclass
class Moment:
    """One moment of one parameter, as the optimizer holds it: `full` (fp32, a DTensor like the
    parameter under FSDP2) where kept in full precision, else this rank's `codes` and `scale`
    (plain tensors, the live ones) and how to place them (`param`: the parameter's tensor or
    DTensor, for shapes and placements)."""

    param: torch.Tensor
    full: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    subclass: Any = None  # torchao's local state (for its qmap and dequantize); None for bitsandbytes
    packed: bool = False  # adamw4bit: two codes per byte, flattened

    @property
    def quantized(self) -> bool:
        return self.full is None

    def global_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of the whole tensor's codes and scales (blocks of the flattened tensor)."""
        n = self.param.numel()
        codes = (n // 2,) if self.packed else tuple(self.param.shape)
        local = self.codes.numel() * (2 if self.packed else 1)  # type: ignore[union-attr]
        return codes, (n * self.scale.numel() // local,)  # type: ignore[union-attr]

    def placed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scale) as the checkpoint names them: plain tensors on a replica, DTensors of
        the whole tensor's codes and scales under FSDP2 (this rank's contiguous part: `quantizes`)."""
        assert self.codes is not None and self.scale is not None
        p = self.param
        if not isinstance(p, DTensor):
            return self.codes, self.scale
        codes_shape, scale_shape = self.global_shapes()
        return tuple(  # type: ignore[return-value]
            DTensor.from_local(t, device_mesh=p.device_mesh, placements=p.placements, run_check=False,
                               shape=torch.Size(shape), stride=_contiguous(shape))
            for t, shape in ((self.codes, codes_shape), (self.scale, scale_shape)))


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def moments(opt: torch.optim.Optimizer, param: torch.Tensor, st: dict[str, Any]) -> dict[str, Moment]:
    """The two moments of the parameter whose state is `st`."""
    out: dict[str, Moment] = {}
    for m in MOMENTS:
        if _is_bnb(opt):
            codes_key, scale_key = BNB_KEYS[m]
            value = st[codes_key]
            out[m] = (Moment(param, full=value) if value.dtype != torch.uint8
                      else Moment(param, codes=value, scale=st[scale_key]))
            continue
        value = st[m]
        local = value._local_tensor if isinstance(value, DTensor) else value
        if type(local) is torch.Tensor:  # torchao keeps it in full precision
            out[m] = Moment(param, full=value)
        else:
            out[m] = Moment(param, codes=local.codes, scale=local.scale, subclass=local,
                            packed=type(local).__name__ == "OptimState4bit")
    return out


Entry = tuple[str, torch.optim.Optimizer, torch.Tensor]  # (FQN, the optimizer holding it, the parameter)


def entries(optimizers: list[torch.optim.Optimizer], optim_sd: dict[str, Any]) -> list[Entry]:
    """Each trained parameter with its FQN, as get_state_dict names it: its `param_groups` list
    the FQNs in the order of the optimizers' own groups and parameters."""
    groups = [(opt, g) for opt in optimizers for g in opt.param_groups]
    named = optim_sd["param_groups"]
    assert len(groups) == len(named), (len(groups), len(named))
    return [(fqn, opt, p) for (opt, g), sg in zip(groups, named, strict=True)
            for p, fqn in zip(g["params"], sg["params"], strict=True)]


def canonical(params: list[Entry]) -> tuple[dict[str, torch.Tensor], int]:
    """The live states -> the checkpoint's moment tensors (aliases of the live codes, scales and
    fp32 states: no copies) and the optimizer's step count."""
    tensors: dict[str, torch.Tensor] = {}
    step = 0
    for fqn, opt, p in params:
        st = opt.state[p]
        for m, mom in moments(opt, p, st).items():
            if mom.quantized:
                tensors[f"optim.{m}_codes.{fqn}"], tensors[f"optim.{m}_scale.{fqn}"] = mom.placed()
            else:
                tensors[f"optim.{m}.{fqn}"] = mom.full  # type: ignore[assignment]
        step = int(st["step"])
    return tensors, step


def load(params: list[Entry], saved: dict[str, tuple[tuple[int, ...], torch.dtype]], read: Any,
         model_tensors: dict[str, torch.Tensor], step: int) -> None:
    """Read the model tensors (`model_tensors`, in place) and every moment from the checkpoint
    whose tensors are `saved` (key -> shape and dtype, from its index) in one read, then put each
    moment into the live state: in place where the checkpoint holds it in this run's form, else
    converted (module docstring). Every parameter's step count becomes `step`."""
    tensors = dict(model_tensors)
    after: list[Any] = []
    for fqn, opt, p in params:
        st = opt.state[p]
        for m, mom in moments(opt, p, st).items():
            full, codes, scale = f"optim.{m}.{fqn}", f"optim.{m}_codes.{fqn}", f"optim.{m}_scale.{fqn}"
            if full in saved and not mom.quantized:
                tensors[full] = mom.full  # type: ignore[assignment]
            elif codes in saved and scale in saved and mom.quantized:
                tensors[codes], tensors[scale] = placed = mom.placed()
                after.append(lambda mom=mom, placed=placed: _copy_back(mom, placed))
            elif full in saved:  # saved fp32, quantized here: torchao's copy quantizes it
                if _is_bnb(opt):
                    raise ShardwiseError(f"{fqn}: the checkpoint holds its {m} in fp32, bitsandbytes' state here "
                                         "is 8-bit; resume with the world size and strategy it was saved with")
                tensors[full] = buf = torch.zeros_like(p)
                after.append(lambda st=st, m=m, buf=buf: st[m].copy_(buf))
            elif codes in saved and scale in saved:  # saved quantized, fp32 here: dequantized, exact
                tensors[codes] = c = torch.empty(saved[codes][0], dtype=saved[codes][1])
                tensors[scale] = s = torch.empty(saved[scale][0], dtype=saved[scale][1])
                after.append(lambda opt=opt, mom=mom, m=m, c=c, s=s: _dequantized_into(opt, mom, m, c, s))
            else:
                raise ShardwiseError(f"the checkpoint holds no {m} state of {fqn!r} (neither {full} nor {codes})")
        _set_step(st, step)
    read(tensors)
    for finish in after:
        finish()


def _copy_back(mom: Moment, placed: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Where the DTensor wrap copied (an offloaded shard wrapped on the mesh's device), the read
    values into the live codes and scale."""
    for live, read in zip((mom.codes, mom.scale), placed, strict=True):
        local = read.to_local() if isinstance(read, DTensor) else read
        if local.data_ptr() != live.data_ptr():  # type: ignore[union-attr]
            live.copy_(local)  # type: ignore[union-attr]


def _dequantized_into(opt: Any, mom: Moment, m: str, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """The whole tensor's saved codes and scales, dequantized, into this rank's fp32 state."""
    if _is_bnb(opt):
        raise ShardwiseError("bitsandbytes' 8-bit state saved for a tensor this run keeps in fp32; resume with the "
                             "world size and strategy it was saved with")
    from torchao.optim import AdamW4bit
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    packed = isinstance(opt, AdamW4bit)
    cls, block = (OptimState4bit, 128) if packed else (OptimState8bit, 256)
    signed = m == "exp_avg"  # torchao: exp_avg signed, exp_avg_sq not (adam.py `step`)
    qmap = cls.zeros((block,), signed, block, device=codes.device).qmap  # the library's table for it
    args = (codes, scale, qmap, signed) + ((tuple(mom.param.shape),) if packed else ())
    whole = cls(*args).dequantize().view(mom.param.shape)
    p, live = mom.param, mom.full
    assert live is not None
    if isinstance(p, DTensor):
        whole = distribute_tensor(whole.to(p.device_mesh.device_type), p.device_mesh, p.placements,
                                  src_data_rank=None).to_local()
        live = live.to_local()
    live.copy_(whole)


def _set_step(st: dict[str, Any], step: int) -> None:
    if isinstance(st["step"], torch.Tensor):
        st["step"].fill_(float(step))
    else:  # bitsandbytes counts in a Python int
        st["step"] = step
