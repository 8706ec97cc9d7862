"""Regional compilation: `torch.compile` per decoder layer, as torchtitan does.

Each decoder layer's `forward` is replaced by its compiled version. The module stays where it
is: parameter names, state dicts and checkpoints are unchanged (no `_orig_mod.`), and the
engines' module hooks (FSDP2's unshard/reshard, DDP's reducer) run outside the compiled region,
around it. Every layer runs the same code, so they share one compiled graph: parameters are graph
inputs (`inline_inbuilt_nn_modules`), and the KV cache is off in training, so there is no
per-layer guard. Compile time is one layer's, not L.

Shapes. The first batch compiles a static graph. The first batch of another sequence length
(packed or padded SFT batches vary) recompiles once with the sequence dimension symbolic
(dynamo's automatic dynamic shapes); after that no shape recompiles. So there are at most two
compilations per run (tests/train/test_compile.py counts them).

Where. `run.compile` (None: on for CUDA; `shardwise.run.resolve.compile_enabled`) applies to
the FSDP2 and DDP engines. DeepSpeed's ZeRO hooks run inside each module's call and are not
compiled here, so `run.compile: true` with a DeepSpeed strategy is refused at preflight. The
planner models compiled layers as `TrainSpec.fused_kernels`: elementwise work priced as fused,
and the norms' saved tensors as a fused kernel's (measured against the plan: docs/training.md
"Compiled decoder layers").
"""

from __future__ import annotations

from typing import Any


def compile_layers(model: Any, backend: str, run: Any = None) -> int:
    """Compile every decoder layer's forward in place; returns how many were compiled.

    A compile that fails (dynamo or inductor raise while compiling, at the first step or at the
    one recompilation for a new sequence length: a missing compiler, an unsupported op, a
    backend bug on the user's GPU) never ends the run: every layer falls back to its eager
    forward from then on, the failing call is run again eagerly, and one warning says why with
    the plan re-priced without compiled layers (`run`, the RunSpec). An error eager also raises
    (a real shape or memory error) then surfaces as itself."""
    import torch

    from shardwise.train.model.hf import decoder_layers

    layers = decoder_layers(model)
    state = {"eager": False}
    for layer in layers:
        eager = layer.forward
        layer.forward = _with_fallback(torch.compile(eager, backend=backend), eager, state, run)
    return len(layers)


def is_compile_error(e: BaseException) -> bool:
    """Raised by torch.compile's machinery (dynamo tracing, a backend, inductor's codegen or its
    C++/CUDA compiler), not by the model's own code running."""
    return any(c.__module__.startswith(("torch._dynamo", "torch._inductor")) for c in type(e).__mro__[:-1])


def _with_fallback(compiled: Any, eager: Any, state: dict[str, Any], run: Any) -> Any:
    import functools

    @functools.wraps(eager)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if state["eager"]:
            return eager(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except Exception as e:
            if not is_compile_error(e):
                raise
            state["eager"] = True
            _warn_fallback(e, run)
            return eager(*args, **kwargs)

    return forward


def compile_error_summary(e: BaseException) -> str:
    """`Error from RootError: first line of the root cause` (the backend's own error, which
    BackendCompilerFailed keeps as `inner_exception`), for a one-line warning."""
    root = e
    while root.__cause__ is not None or getattr(root, "inner_exception", None) is not None:
        root = root.__cause__ or root.inner_exception
    first = (str(root).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}" + (f" from {type(root).__name__}" if root is not e else "") + f": {first}"


def _warn_fallback(e: BaseException, run: Any) -> None:
    import os
    import sys

    msg = (f"shardwise: rank {os.environ.get('RANK', '0')}: torch.compile of the decoder layers failed "
           f"({compile_error_summary(e)}); they run eager from here (set run.compile: false to skip compiling)")
    if run is not None:
        msg += f"; {replanned_without_compile(run)}"
    print(msg, file=sys.stderr, flush=True)


def replanned_without_compile(run: Any) -> str:
    """The plan of this run with and without compiled layers: what the fallback costs."""
    from shardwise.numfmt import rate
    from shardwise.plan.evaluate import evaluate
    from shardwise.specs.hardware import GIB

    eager_train = run.train.model_copy(update={"fused_kernels": False})
    was = evaluate(run.model, run.hardware, run.train, run.strategy)
    now = evaluate(run.model, run.hardware, eager_train, run.strategy)
    return (f"re-planned eager: {rate(now.time.tokens_per_s_per_gpu)} tokens/s per GPU and "
            f"{now.memory.gpu.total / GIB:.1f} GiB (compiled: {rate(was.time.tokens_per_s_per_gpu)} and "
            f"{was.memory.gpu.total / GIB:.1f} GiB)")
