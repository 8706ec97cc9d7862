"""Learning-rate schedules (shapes, not copied numbers) and launcher detection."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from shardwise.train.launch.rank import detect_env
from shardwise.train.schedule import lr_at

PEAK, TOTAL, WARM = 1e-3, 100, 10


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant", "warmup_decay"])
def test_warmup_is_linear_and_reaches_peak(kind):
    lrs = [lr_at(s, peak=PEAK, total=TOTAL, kind=kind, warmup=WARM) for s in range(WARM)]
    assert lrs[0] == pytest.approx(PEAK / WARM) and lrs[-1] == pytest.approx(PEAK)
    assert all(b - a == pytest.approx(PEAK / WARM) for a, b in itertools.pairwise(lrs))


def test_decay_shapes():
    def at(kind, s, **kw):
        return lr_at(s, peak=PEAK, total=TOTAL, kind=kind, warmup=WARM, **kw)

    mid = WARM + (TOTAL - WARM) // 2
    assert at("cosine", mid) == pytest.approx(PEAK / 2)  # cos(pi/2) = 0: half way
    assert at("linear", mid) == pytest.approx(PEAK / 2)
    assert at("cosine", TOTAL, min_ratio=0.1) == pytest.approx(0.1 * PEAK)
    assert at("constant", TOTAL - 1) == PEAK
    # WarmupDecayLR: linear to zero at the last step.
    assert at("warmup_decay", TOTAL) == 0.0
    cos = [at("cosine", s) for s in range(WARM, TOTAL)]
    assert all(b <= a for a, b in itertools.pairwise(cos)) and not math.isnan(sum(cos))


def test_detect_launchers():
    assert detect_env({}) is None
    tr = detect_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"})
    assert tr == {"launcher": "torchrun", "rank": 3, "world_size": 8, "local_rank": 1}
    assert detect_env({"RANK": "0", "WORLD_SIZE": "2", "DEEPSPEED_RANK": "0"})["launcher"] == "deepspeed"
    srun = detect_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"})
    assert srun == {"launcher": "srun", "rank": 5, "world_size": 16, "local_rank": 1}
    assert detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None  # an allocation, not a launch


_EXIT_PROBE = """
import atexit, sys
from shardwise.train.launch import rank as launch
atexit.register(lambda: print("atexit ran", flush=True))
launch._JOINED_GROUP = {joined}
def main():
    print("body", flush=True)
    {body}
launch.run_cli(main)
"""


@pytest.mark.parametrize(
    ("joined", "body", "code"),
    [
        (False, "return 3", 3),
        (True, "return 3", 3),
        (True, "sys.exit()", 0),  # typer's normal end: SystemExit(None) is success
        (True, "raise RuntimeError('boom')", 1),
        (False, "sys.exit('usage: x')", 1),
    ],
)
def test_run_cli_skips_interpreter_shutdown_only_after_joining_a_group(joined, body, code):
    """A process that joined a process group ends by os._exit (gloo can abort in Py_FinalizeEx),
    so atexit handlers do not run; any other command exits normally and they do."""
    import subprocess
    import sys

    src = _EXIT_PROBE.format(joined=joined, body=body)
    p = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=60)
    assert p.returncode == code, p.stderr
    assert p.stdout.startswith("body")  # flushed before the exit
    assert ("atexit ran" in p.stdout) is (not joined)
    if "boom" in body:
        assert "RuntimeError: boom" in p.stderr
    if "usage" in body:
        assert "usage: x" in p.stderr


LAUNCHER_PROBE = """
import os, sys
import shardwise.train.cli as cli
import shardwise.train.launch.spawn as spawn

preload = cli._preload

def probed_preload(run):
    print("torch imported by the checks:", "torch" in sys.modules, "transformers" in sys.modules)
    preload(run)

def probe(*args, fork_target=None, **kwargs):
    loaded = ("transformers.models.qwen2.modeling_qwen2", "shardwise.train.engines.fsdp", "shardwise.train.loop")
    print("loaded for the ranks:", all(m in sys.modules for m in loaded))
    import torch
    print("ranks forked:", fork_target is not None, "| launcher threads:", torch.get_num_threads(),
          os.environ["OMP_NUM_THREADS"], os.environ["MKL_NUM_THREADS"], "| rank threads:", kwargs["threads_per_rank"],
          "| given back:", {k: kwargs["extra_env"].get(k, "-") for k in ("MKL_NUM_THREADS", "OMP_NUM_THREADS")})
    return spawn.SpawnResult(0)

cli._preload = probed_preload
spawn.spawn_job = probe
sys.argv = ["shardwise-train", *sys.argv[1:]]
cli.main()
"""


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_the_launcher_checks_a_fresh_run_without_torch_then_forks_single_threaded(tmp_path, device):
    """Every preflight check of a fresh 2-rank CPU run (the chunked loss's model check included)
    runs without torch or transformers' modeling code; then the launcher imports what a rank
    imports (the model's code, the engine, the loop), once, and forks its ranks from a process whose OpenMP and MKL pools were held to
    one thread since before torch loaded (shardwise.train.launch.fork: libgomp is not fork-safe);
    the ranks get their own thread count, and the user's MKL_NUM_THREADS (here unset) back.
    `run.device: auto` (the default) forks too: it is decided after the launcher is single-threaded."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).parents[2]
    argv = [
        sys.executable,
        "-c",
        LAUNCHER_PROBE,
        str(repo / "examples" / "fsdp-synthetic-cpu.yaml"),
        "--nproc",
        "2",
        "--set",
        f"checkpointing.output_dir={tmp_path}",
        "--set",
        f"run.device={device}",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, env=env)
    # `auto` asks torch for a GPU (none here), after the launcher was made single-threaded
    assert f"torch imported by the checks: {device == 'auto'} False" in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])
    assert "loaded for the ranks: True" in r.stdout
    threads = max(1, (os.cpu_count() or 1) // 2)
    assert (f"ranks forked: True | launcher threads: 1 1 1 | rank threads: {threads} | given back: "
            "{'MKL_NUM_THREADS': None, 'OMP_NUM_THREADS': '-'}") in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])
