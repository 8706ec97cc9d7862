"""How deep the loss sits: the Python frames between `shardwise train` and the chunked loss.

Runs `shardwise train examples/demo.yaml` (FSDP2 on 2 CPU ranks, the README's demo) for one
step with `benchmarks/loss_path_probe/sitecustomize.py` first on PYTHONPATH, which records
rank 0's stack at the first call of `linear_cross_entropy_sum`. Writes
benchmarks/results/loss_path.json: every frame, and the shardwise frames and files among them
(docs/architecture.md quotes `render`'s block between its loss-path markers;
tests/train/test_architecture_doc.py keeps the quote and the frames' functions current).

    python benchmarks/loss_path.py            # ~1 min on 2 cores; --doc rewrites the quote
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "loss_path.json"
PROBE = ROOT / "benchmarks" / "loss_path_probe"


def measure() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stack.json"
        env = {**os.environ, "LOSS_PATH_OUT": str(out), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(PROBE), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        cmd = [shutil.which("shardwise") or "shardwise", "train", str(ROOT / "examples" / "demo.yaml"),
               "--set", "run.steps=1", "--set", f"checkpointing.output_dir={tmp}/run"]
        subprocess.run(cmd, env=env, check=True, cwd=tmp, stdout=subprocess.DEVNULL)
        frames = json.loads(out.read_text())
    src = str(ROOT / "src" / "shardwise") + os.sep
    ours = [{"file": f["file"][len(src):], "function": f["function"]} for f in frames if f["file"].startswith(src)]
    return {
        "command": "shardwise train examples/demo.yaml --set run.steps=1",
        "stack": "rank 0's, of 2 CPU ranks forked by the launcher, fsdp",
        "frames": len(frames),
        "shardwise_frames": len(ours),
        "shardwise_files": len({f["file"] for f in ours}),
        "path": ours,
    }


DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- loss_path.py: begin -->", "<!-- loss_path.py: end -->"


def render(result: dict) -> str:
    """The doc's block: the counts, then the shardwise frames, outermost first, one line per
    run of frames in the same file."""
    lines = [f"{result['shardwise_frames']} shardwise frames in {result['shardwise_files']} files "
             f"({result['frames']} Python frames in all); `{result['command']}`, {result['stack']}:", "", "```"]
    runs: list[tuple[str, list[str]]] = []
    for f in result["path"]:
        if runs and runs[-1][0] == f["file"]:
            runs[-1][1].append(f["function"])
        else:
            runs.append((f["file"], [f["function"]]))
    width = max(len(file) for file, _ in runs)
    lines += [f"{file:<{width}}  {' → '.join(funcs)}" for file, funcs in runs]
    return "\n".join([*lines, "```"])


def quoted(doc: str) -> str:
    return doc[doc.index(BEGIN) + len(BEGIN):doc.index(END)].strip("\n")


if __name__ == "__main__":
    if "--doc" not in sys.argv:
        result = measure()
        RESULT.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k != "path"}))
    result = json.loads(RESULT.read_text())
    doc = DOC.read_text()
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    DOC.write_text(doc[:start] + "\n" + render(result) + "\n" + doc[end:])
