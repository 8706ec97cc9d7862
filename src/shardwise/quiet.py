"""Third-party warnings, handled where they come from; `--verbose` shows them all.

Warnings that shardwise's own calls would cause are avoided at their source, not filtered here
(docs/training.md, "Warnings"):
- torch's FutureWarning on the deprecated `all_gather_into_tensor` / `reduce_scatter_tensor`:
  DeepSpeed's backend calls their successors (shardwise.train.engines.deepspeed.deepspeed_comm);
- DeepSpeed's "Attempting to get learning rate from scheduler before it has started": the engine
  has DeepSpeed build no lr scheduler beside the loop's (shardwise.train.engines.deepspeed);
- transformers' deprecated `is_gradient_checkpointing`, which PEFT's `PeftModel` reads: the one
  call that wraps a model in it ignores that one warning (shardwise.train.model.lora.peft_model).

What is left here cannot be fixed from shardwise: messages a library prints on import that say
nothing about the run. Each entry names exactly what it silences and why. `--verbose` on `train`
and `bench` (the environment variable SHARDWISE_VERBOSE=1, which spawned ranks inherit) installs
none of them and shows every warning, DeprecationWarnings included (Python's "default" action).
"""

from __future__ import annotations

import logging
import os
import warnings

VERBOSE_ENV = "SHARDWISE_VERBOSE"

# (logger, level it is set to, why)
QUIET_LOGGERS: tuple[tuple[str, int, str], ...] = (
    ("bitsandbytes.backends.cpu.ops", logging.ERROR,
     "bitsandbytes logs 'Failed to load CPU gemm_4bit_forward from kernels-community' on every rank "
     "whenever PEFT imports it on a CPU with AVX512-BF16, unless the optional `kernels` package is "
     "installed; that CPU 4-bit kernel is never used here (lora.quantization nf4 is CUDA-only)"),
)


# (logger, how the message starts, why): one message of a logger whose other messages may matter
QUIET_MESSAGES: tuple[tuple[str, str, str], ...] = (
    ("torchao", "Failed to load ",
     "torchao logs one line on import for each optional compiled extension built for another Python or "
     "CUDA (its MX/FP8 GEMMs, CUTLASS kernels); the low-bit optimizers (optimizer.name adamw8bit, "
     "adamw4bit) use none of them"),
    ("torch.utils._pytree", "<enum ",
     "torchao 0.18 registers two Enums with pytree on import, which torch 2.13 logs as deprecated "
     "(`register_constant` on an Enum subclass): nothing a run does, nothing shardwise can change"),
)
# (message regex, category, why): warnings a library raises once per process
QUIET_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    (r"OptimState(8|4)bit does not implement _stable_hash_for_caching", UserWarning,
     "torch's AOT autograd cache on the first compiled step of torchao's low-bit AdamW: its state "
     "subclasses have no stable hash, so that graph is not cached across processes (the FX graph "
     "cache still is); a note to torchao, not to the run"),
)


class _DropMessages(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def verbose() -> bool:
    """`--verbose` was given here or to the process that spawned this rank."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def apply(verbose_flag: bool | None = None) -> None:
    """Set this process's warning policy (call it first thing in every entry point: the train
    and bench CLIs, a bench rank). `verbose_flag` True also exports SHARDWISE_VERBOSE=1 for the
    ranks this process starts; None reads it from the environment."""
    if verbose_flag:
        os.environ[VERBOSE_ENV] = "1"
    if verbose() if verbose_flag is None else verbose_flag:
        warnings.simplefilter("default")  # every warning, once per location (DeprecationWarning too)
        return
    for name, level, _why in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(level)
    for name in {n for n, _, _ in QUIET_MESSAGES}:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(tuple(m for n, m, _ in QUIET_MESSAGES if n == name)))
    for message, category, _why in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
