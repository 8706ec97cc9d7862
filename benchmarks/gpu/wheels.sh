#!/usr/bin/env bash
# Run HERE (a machine with pip access) before a GPU session: the packages shardwise needs that the
# device image lacks (docs: the device tool's README), as wheels for its Python 3.12 in ./.whl
# (git-ignored; carried by the `run` call: carry [".whl"]). About 50 MiB, bitsandbytes most of it.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
         "${plat[@]}" -d .whl "$@"; }
v() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
dl "pydantic==$(v pydantic)" "pydantic-core==$(v pydantic_core)" "annotated-types==$(v annotated-types)" \
   "typing-inspection==$(v typing-inspection)" "hjson==$(v hjson)" "bitsandbytes==$(v bitsandbytes)" \
   "torchao==$(v torchao)"
# deepspeed has no wheel on PyPI: built here it is pure Python (its ops compile where they run)
python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$(v deepspeed)"
ls -la .whl && du -sh .whl
