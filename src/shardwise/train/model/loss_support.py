"""Where the chunked cross-entropy reproduces a model's logits: read from the source of its
CausalLM class's `forward`, what it does to lm_head's output before returning it as `.logits`.

Torch-free: the launcher refuses an unsupported run before any rank starts (`check_run`) from
transformers' files alone (shardwise.train.model.hf.forward_source), without importing torch or the
modeling code, seconds of start-up in a process that trains nothing; each rank checks the class
of the model it built (shardwise.train.model.loss.install_loss_heads)."""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from shardwise.errors import ShardwiseError

STANDARD_HINT = "set loss.implementation: standard (--set loss.implementation=standard)"
_ASSIGN = re.compile(r"^\s*(\w+)\s*=\s*self\.(lm_head|get_output_embeddings\(\))\(")


def forward_support(name: str, forward_source: str) -> tuple[bool, str | None]:
    """(soft-capped, refusal) for the CausalLM class `name` whose `forward` reads
    `forward_source`. Nothing done to lm_head's output: supported. Gemma 2/3's
    `final_logit_softcapping` lines: supported (the LossHead folds the cap into the loss and
    switches the model's own off for the call). Anything else (Cohere's logit_scale, Granite's
    logits_scaling, ...): refused, naming the line."""
    lines = forward_source.splitlines()
    for i, line in enumerate(lines):
        m = _ASSIGN.match(line)
        if m:
            var, start = m.group(1), i + 1
            break
    else:
        return False, f"{name}.forward does not call self.lm_head(...)"
    edits = []
    for line in lines[start:]:
        s = line.strip()
        if s.startswith(("loss", "if labels", "return", "output")):
            break
        if re.match(rf"{var}\s*([-+*/]?=)", s) and not re.fullmatch(rf"{var}\s*=\s*{var}\.float\(\)", s):
            edits.append(s)
    if not edits:
        return False, None
    if all(
        "final_logit_softcapping" in s or re.fullmatch(rf"{var}\s*=\s*torch\.tanh\({var}\)", s) for s in edits
    ):
        return True, None
    return False, (
        f"{name} changes the logits after lm_head ({edits[0]!r}), which the chunked "
        f"cross-entropy does not fold in"
    )


@functools.cache
def head_support(cls: Any) -> tuple[bool, str | None]:
    """`forward_support` of a CausalLM class, from its `forward`'s source."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False, f"{cls.__name__}.forward has no readable source to check what it does to the logits"
    return forward_support(cls.__name__, src)


def check_run(run: Any) -> None:
    """Preflight: refuse `loss.implementation: chunked` before any rank starts where it cannot
    reproduce the model's logits: LoRA adapts lm_head, or the model's CausalLM class changes
    the logits after lm_head (other than Gemma's soft-cap). A class only a checkpoint's own code
    defines is checked when the model is built (shardwise.train.model.loss.install_loss_heads)."""
    from shardwise.train.model.hf import causal_lm_class, causal_lm_name, forward_source, run_model_type

    if run.train.cross_entropy != "chunked":
        return
    cfg = run.config
    targets = cfg.lora.target_modules if cfg.lora is not None else []
    if isinstance(targets, list) and any(t == "lm_head" or t.endswith(".lm_head") for t in targets):
        raise ShardwiseError(
            f"{cfg.source}: lora.target_modules adapts lm_head, but the chunked cross-entropy "
            f"computes the loss inside a plain linear lm_head; {STANDARD_HINT}"
        )
    model_type = run_model_type(run)
    name = causal_lm_name(model_type)
    if name is None:  # a checkpoint's own code decides: checked when the model is built
        return
    src = forward_source(model_type, name)
    if src is not None:
        refusal = forward_support(name, src)[1]
    else:
        cls = causal_lm_class(model_type)
        refusal = head_support(cls)[1] if cls is not None else None
    if refusal:
        raise ShardwiseError(
            f"{cfg.source}: loss.implementation is 'chunked', but {refusal}; {STANDARD_HINT}"
        )
