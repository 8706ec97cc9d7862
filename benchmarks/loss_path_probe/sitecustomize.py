"""Put first on PYTHONPATH by benchmarks/loss_path.py: once shardwise's loss module is imported,
its `linear_cross_entropy_sum` is wrapped so that its first call on rank 0 writes the Python
stack (file, line, function per frame) to $LOSS_PATH_OUT as JSON. Nothing else changes."""

import importlib.abc
import json
import os
import sys
import traceback

_MODULE = "shardwise.train.model.loss"


def _wrap(module) -> None:
    inner = module.linear_cross_entropy_sum

    def linear_cross_entropy_sum(*args, **kwargs):
        out = os.environ.get("LOSS_PATH_OUT")
        if out and os.environ.get("RANK", "0") == "0" and not os.path.exists(out):
            frames = [{"file": f.filename, "line": f.lineno, "function": f.name}
                      for f in traceback.extract_stack()[:-1]]
            with open(out, "w") as fh:
                json.dump(frames, fh)
        return inner(*args, **kwargs)

    module.linear_cross_entropy_sum = linear_cross_entropy_sum


class _After(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _wrap(module)

        spec.loader.exec_module = exec_module
        return spec


import importlib.util  # noqa: E402

sys.meta_path.insert(0, _After())
