"""ZeRO-3 gathered-parameter trace (benchmarks/zero3_gathered.py): imported at start-up by every
rank of a `shardwise train` launched with this directory first on PYTHONPATH. It runs
benchmarks/host_memory_probe's phase probe as well, and wraps DeepSpeed's four ZeRO-3 module hooks
(DeepSpeedZeRoOffload.pre/post_sub_module_forward/backward_function), the coordinator's
reset_step and the engine's backward/step, appending one JSON line per event to
$SHARDWISE_Z3_TRACE_DIR/rank<RANK>.jsonl: the module, the elements of parameters whose
ds_status is AVAILABLE (all / frozen / trainable, and which decoder layers hold any), the
coordinator's own count and trace mode, and VmRSS. It only reads."""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_PHASES = os.path.join(os.path.dirname(_HERE), "host_memory_probe", "sitecustomize.py")
if os.environ.get("SHARDWISE_HOST_PHASES_DIR"):
    exec(compile(open(_PHASES).read(), _PHASES, "exec"))  # the phase rows too

_TRACE = os.environ.get("SHARDWISE_Z3_TRACE_DIR")
_state = {"step": 0, "pass": "init", "names": None, "params": None, "f": None}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _emit(offload, event: str, module=None) -> None:
    import json

    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if _state["params"] is None:
        root = offload.module
        _state["names"] = {id(m): n for n, m in root.named_modules()}
        _state["params"] = [(n, p) for n, p in root.named_parameters() if hasattr(p, "ds_numel")]
    avail = frozen = train = data = 0
    layers = set()
    other = []
    for n, p in _state["params"]:
        if p.ds_status == ZeroParamStatus.AVAILABLE:
            avail += p.ds_numel
            data += p.data.numel()
            if p.requires_grad:
                train += p.ds_numel
            else:
                frozen += p.ds_numel
            if getattr(p, "ds_persist", False):
                continue
            if ".layers." in n:
                layers.add(int(n.split(".layers.")[1].split(".")[0]))
            else:
                other.append(n.rsplit(".", 2)[-2])
    coord = offload.get_param_coordinator()
    mode = getattr(coord, "_PartitionedParameterCoordinator__trace_mode", None)
    row = {"step": _state["step"], "pass": _state["pass"], "event": event,
           "module": None if module is None else _state["names"].get(id(module), type(module).__name__),
           "avail": avail, "avail_frozen": frozen, "avail_train": train, "avail_data": data,
           "coord_n_available": getattr(coord, "_PartitionedParameterCoordinator__n_available_params", None),
           "trace": None if mode is None else mode.name, "layers": sorted(layers), "other": sorted(set(other)),
           "rss": _rss()}
    if _state["f"] is None:
        _state["f"] = open(os.path.join(_TRACE, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a")
    _state["f"].write(json.dumps(row) + "\n")
    _state["f"].flush()


def _patch_offload(mod) -> None:
    cls = mod.DeepSpeedZeRoOffload
    for name in ("pre_sub_module_forward_function", "post_sub_module_forward_function",
                 "pre_sub_module_backward_function", "post_sub_module_backward_function"):
        orig = getattr(cls, name)

        def wrapped(self, sub_module, _orig=orig, _name=name):
            out = _orig(self, sub_module)
            _emit(self, _name.replace("_sub_module", "").replace("_function", ""), sub_module)
            return out

        setattr(cls, name, wrapped)
    _state["cls"] = cls


def _patch_engine(mod) -> None:
    cls = mod.DeepSpeedEngine
    fwd, bwd, step = cls.forward, cls.backward, cls.step

    def forward(self, *a, **k):
        _state["step"] += 1
        _state["pass"] = "fwd"
        if getattr(self, "optimizer", None) is not None and hasattr(self.optimizer, "parameter_offload"):
            _emit(self.optimizer.parameter_offload, "engine_forward_start")
        out = fwd(self, *a, **k)
        if hasattr(self.optimizer, "parameter_offload"):
            _emit(self.optimizer.parameter_offload, "engine_forward_end")
        return out

    def backward(self, *a, **k):
        _state["pass"] = "bwd"
        out = bwd(self, *a, **k)
        if hasattr(self.optimizer, "parameter_offload"):
            _emit(self.optimizer.parameter_offload, "engine_backward_end")
        return out

    def stepped(self, *a, **k):
        _state["pass"] = "step"
        out = step(self, *a, **k)
        if hasattr(self.optimizer, "parameter_offload"):
            _emit(self.optimizer.parameter_offload, "engine_step_end")
        return out

    cls.forward, cls.backward, cls.step = forward, backward, stepped


if _TRACE and os.environ.get("RANK") is not None:
    import importlib.abc
    import importlib.util

    _TARGETS = {"deepspeed.runtime.zero.parameter_offload": _patch_offload,
                "deepspeed.runtime.engine": _patch_engine}

    class _Z3Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in _TARGETS:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            exec_module, patch = spec.loader.exec_module, _TARGETS[name]

            def patched(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = patched
            return spec

    sys.meta_path.insert(0, _Z3Finder())
