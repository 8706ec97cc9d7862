"""Host memory of CPU training through the user's own command, per engine, term by term.

Each case runs `python -m shardwise.train.cli CONFIG` as a subprocess on 2 CPU ranks, the whole
job (launcher + ranks) in a fresh cgroup v1 memory controller (`/sys/fs/cgroup/memory/<unique>`:
the child writes its own pid to `cgroup.procs` before it execs, so every rank is in it), and
records:

- the job's peak (`memory.max_usage_in_bytes`: anonymous memory and the page cache of the files
  read, which the kernel reclaims under a cap) and `memory.failcnt`;
- the launcher's own peak RSS (its VmHWM, read every 0.5 s while it runs), and the peak RSS of
  the largest process of the job (`wait4`'s rusage: its own and its waited-for
  ranks' `ru_maxrss`), and rank 0's own peak from its metrics.jsonl (the trainer's "host peak RSS").
  The probe resets each rank's peak once the weights are in, so both count from there: a rank's
  peak over the whole run is the larger of its `load_peak` and `train_peak`;
- per rank and per phase, through `benchmarks/host_memory_probe/sitecustomize.py` (first on the
  ranks' PYTHONPATH; it only reads): VmRSS, RssAnon, RssFile, VmHWM and glibc's heap in use /
  free / mmapped at start (imports done, nothing built), after the model is built, after the
  engine placed and loaded it (VmHWM: the load's peak, then reset), after each forward+backward
  and each optimizer step (VmHWM: the training's peak);
- the process baseline of a fresh interpreter that imports what a rank imports (python, torch,
  torch.distributed, transformers, peft, deepspeed, shardwise's trainer), and nothing else;
- the terms of the host-memory model (bytes, from the checkpoint's config.json), beside the
  measured values they predict, and the planner's load phase (shardwise.plan.load).

Cases: LoRA (r 8, q_proj/v_proj, bf16-mixed) on the 1.36B Llama under fsdp, zero3, zero2, ddp;
full fine-tuning (bf16-mixed) of the 134M Llama under the same four. Checkpoints are random bf16
Llamas in 500 MB safetensors shards (tests/train/big_checkpoint.py), cached in --cache, with the
bundled tokenizer beside them. Needs root (cgroup v1 at /sys/fs/cgroup/memory) and ~10 GiB.

    python benchmarks/host_memory.py [--cache DIR] [--cases fsdp-lora-1.36b,...] [--steps 2] [--cap-gib X]

Writes benchmarks/results/host_memory.json (merged with the cases already there when --cases
picks some); `--table` prints it as markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "host_memory.json"
PROBE = ROOT / "benchmarks" / "host_memory_probe"
CGROUP = Path("/sys/fs/cgroup/memory")
GIB = 2**30
RANKS = 2
SEQ = 64
LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
STRATEGIES = ("fsdp", "zero3", "zero2", "ddp")
DEMO = ROOT / "examples" / "demo.yaml"
DEMO_STEPS = 20
# name: (strategy, mode, model); model "demo" is the README's examples/demo.yaml as shipped (the
# bundled tiny Llama, fp32, seq 256 × micro-batch 4 × accum 2), run for DEMO_STEPS steps
CASES = ({f"demo-{s}": (s, "demo", "demo") for s in STRATEGIES}
         | {f"{s}-lora-1.36b": (s, "lora", "llama-1.36b") for s in STRATEGIES}
         | {f"{s}-full-374m": (s, "full", "llama-374m") for s in STRATEGIES}
         | {f"{s}-full-134m": (s, "full", "llama-134m") for s in STRATEGIES})

# What a rank has imported before it builds anything, by engine: the process baseline.
BASELINE_IMPORTS = {
    "torch_engines": "import torch, torch.distributed, transformers, peft; import shardwise.train.cli, "
                     "shardwise.train.loop, shardwise.train.engines.fsdp, shardwise.train.engines.ddp",
    "deepspeed": "import torch, torch.distributed, transformers, peft, deepspeed; import shardwise.train.cli, "
                 "shardwise.train.loop, shardwise.train.engines.deepspeed",
}


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(PROBE), str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def checkpoint(cache: Path, name: str) -> Path:
    sys.path.insert(0, str(ROOT / "tests" / "train"))
    from big_checkpoint import make_checkpoint

    from shardwise.data import default_tokenizer_path

    out = make_checkpoint(cache, name)
    for f in default_tokenizer_path().iterdir():
        if f.is_file() and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
    return out


def write_config(out: Path, ckpt: Path | None, strategy: str, mode: str, steps: int) -> Path:
    import yaml

    if mode == "demo":
        cfg = yaml.safe_load(DEMO.read_text())
        cfg["strategy"] = {"name": strategy}
        cfg["run"]["steps"] = DEMO_STEPS
        cfg["checkpointing"] = {"output_dir": str(out / "out"), "save_final": False}
        cfg["logging"] = {"progress": False, "every": 5}
        path = out / "config.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path
    cfg = {
        "model": {"path": str(ckpt)},
        "data": {"kind": "sft", "sft": {"max_length": SEQ, "packing": True}},
        "strategy": {"name": strategy},
        "optimizer": {"lr": 1.0e-4, "weight_decay": 0.0},
        "precision": "bf16-mixed",
        "run": {"steps": steps, "micro_batch": 1, "grad_accum": 1, "nproc": RANKS, "device": "cpu"},
        "checkpointing": {"output_dir": str(out / "out"), "save_final": False},
        "logging": {"progress": False},
    }
    if mode == "lora":
        cfg["lora"] = dict(LORA)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_in_cgroup(cmd: list[str], env: dict[str, str], name: str, cap: int | None) -> dict:
    """Run `cmd` as the only member of a new memory cgroup (tests/train/cgroup_run.py); its peak,
    failcnt and the largest process's peak RSS (wait4)."""
    sys.path.insert(0, str(ROOT / "tests" / "train"))
    from cgroup_run import memory_cgroup

    with memory_cgroup(cap, name) as join:
        group = join.group
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                preexec_fn=join, text=True)
        launcher = {"VmHWM": 0}

        def watch() -> None:  # the launcher's own peak: its VmHWM, read until it exits (no wait here:
            while True:         # the main thread reaps it with wait4, for its rusage)
                try:
                    with open(f"/proc/{proc.pid}/status") as f:
                        fields = dict(line.split(":", 1) for line in f if ":" in line)
                except OSError:
                    return
                if "VmHWM" not in fields:  # a zombie: exited
                    return
                launcher["VmHWM"] = int(fields["VmHWM"].split()[0]) * 1024
                time.sleep(0.5)

        threading.Thread(target=watch, daemon=True).start()
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
        return {"rc": proc.returncode, "wall_s": round(time.monotonic() - t0, 1),
                "cgroup_peak": int((group / "memory.max_usage_in_bytes").read_text()),
                "cgroup_failcnt": int((group / "memory.failcnt").read_text()),
                "cgroup_cache_at_end": int(stat.get("total_cache", 0)),
                "largest_process_peak_rss": usage.ru_maxrss * 1024, "launcher_peak_rss": launcher["VmHWM"],
                "output_tail": out[-3000:]}


_STATUS = ("import json, os\ndef status():\n    d = {}\n    for line in open('/proc/self/status'):\n"
           "        k, _, v = line.partition(':')\n"
           "        if k in ('VmRSS', 'RssAnon', 'RssFile'):\n            d[k] = int(v.split()[0]) * 1024\n"
           "    return d\n")
# A forking launcher (shardwise.train.launch.fork): single-threaded, the rank's imports and the
# model's transformers code loaded, collections frozen; the child reports right after the fork.
_FORKED = ("import gc\nfrom transformers.models.llama import modeling_llama\ngc.freeze()\npid = os.fork()\n"
           "if pid == 0:\n    print(json.dumps(status()), flush=True)\n    os._exit(0)\nos.waitpid(pid, 0)\n")


def baseline(env: dict[str, str]) -> dict:
    """VmRSS/RssAnon/RssFile of a fresh interpreter once it imported what a rank of each engine
    imports (`BASELINE_IMPORTS`): an exec'd rank's process. And `forked`: those of a rank forked
    from a launcher that imported the same, right after the fork: the anonymous pages it shares
    with the launcher count in its RSS, the library files' pages only once it touches them."""
    env = {k: v for k, v in env.items() if k != "SHARDWISE_HOST_PHASES_DIR"}
    out: dict = {}
    for name, imports in BASELINE_IMPORTS.items():
        run = subprocess.run([sys.executable, "-c", f"{imports}\n{_STATUS}print(json.dumps(status()))"], env=env,
                             capture_output=True, text=True, check=True)
        out[name] = json.loads(run.stdout.strip().splitlines()[-1])
        forked_env = env | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        run = subprocess.run([sys.executable, "-c", f"{imports}\n{_STATUS}{_FORKED}"], env=forked_env,
                             capture_output=True, text=True, check=True)
        out.setdefault("forked", {})[name] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def shapes(ckpt: Path) -> dict:
    """Parameter counts of the checkpoint's Llama, and of the LoRA adapters on it."""
    c = json.loads((ckpt / "config.json").read_text())
    h, f, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = c["num_key_value_heads"] * c.get("head_dim", h // c["num_attention_heads"])
    layer = h * h * 2 + h * kv * 2 + 3 * h * f + 2 * h
    root = v * h * (1 if c.get("tie_word_embeddings") else 2) + h
    lora_layer = LORA["rank"] * (h + h) + LORA["rank"] * (h + kv)  # q_proj (h->h), v_proj (h->kv)
    return {"params": layers * layer + root, "layer": layer, "root": root, "lora": layers * lora_layer}


def model_terms(strategy: str, mode: str, s: dict) -> dict:
    """Bytes per rank of the host-memory model's terms (bf16-mixed, RANKS = n ranks, c = 2).

    states, what lives between steps. LoRA: the frozen base in bf16 (1/n of it where the engine
    shards parameters), the fp32 adapters, their fp32 grads and AdamW moments (16 B/param;
    sharded under fsdp/zero3). Full fine-tuning: FSDP2 fp32 sharded params, grads, moments
    (16/n B/param); ZeRO-3 bf16 params, bf16 grads, fp32 master and moments partitioned
    (16/n); ZeRO-2 bf16 params whole, fp32 master and moments partitioned (2 + 12/n; its grads
    live from backward to the step); DDP fp32 params, grads (the buckets), moments (16).
    gathered, what a step adds on top. FSDP2 LoRA: the root group (embeddings, norm, lm_head)
    in bf16 from forward to backward, and while it gathers its input copy and flat output
    (c·R·(2 + 1/n)). FSDP2 full: the root's backward, its bf16 unsharded grad, the fp32 copy
    reduce-scattered and the fp32 shard out (c·R held + c·R + 4·R + 4·R/n). ZeRO-3: the params
    DeepSpeed keeps gathered (`zero3_gathered`). ZeRO-2/3 full: the optimizer step's fp32
    gradient partition and AdamW's two temporaries of the flat partition (12/n B/param). DDP
    full: autocast's bf16 copies of the weights, kept for backward (2 B/param). DDP/ZeRO-2
    LoRA: nothing of the model's size."""
    n, c, psi, lora, root = RANKS, 2, s["params"], s["lora"], s["root"]
    if mode == "lora":
        base = c * psi / n if strategy in ("fsdp", "zero3") else c * psi
        train = 16 * lora / (n if strategy in ("fsdp", "zero3") else 1)
        states = {"base_bf16": base, "adapters_fp32_grads_adamw": train}
    elif strategy == "fsdp":
        states = {"params_fp32": 4 * psi / n, "grads_fp32": 4 * psi / n, "adamw": 8 * psi / n}
    elif strategy == "zero3":
        states = {"params_bf16": 2 * psi / n, "grads_bf16": 2 * psi / n, "master_fp32": 4 * psi / n,
                  "adamw": 8 * psi / n}
    elif strategy == "zero2":
        states = {"params_bf16": 2 * psi, "master_fp32": 4 * psi / n, "adamw": 8 * psi / n}
    else:
        states = {"params_fp32": 4 * psi, "grads_fp32": 4 * psi, "adamw": 8 * psi}
    gathered: dict[str, float] = {}
    if strategy == "fsdp" and mode == "lora":
        gathered = {"root_bf16": c * root, "root_gather_transient": c * root * (1 / n + 1)}
    elif strategy == "fsdp":
        gathered = {"root_bf16": c * root, "root_backward": c * root + 4 * root + 4 * root / n}
    elif strategy == "zero3":
        gathered = {"zero3_gathered": c * zero3_gathered(s)}
    if strategy in ("zero2", "zero3") and mode == "full":
        gathered["optimizer_step"] = 12 * psi / n
    if strategy == "ddp" and mode == "full":
        gathered = {"autocast_bf16_weights": 2 * psi}
    return {"states": states, "gathered": gathered}


def zero3_gathered(s: dict) -> float:
    """Elements ZeRO-3 keeps gathered (DeepSpeed defaults: reuse distance and max live 1e9,
    prefetch bucket 5e7): plan/stage.py's rule, on this checkpoint's shapes."""
    reuse, prefetch = 1e9, 5e7
    layers = 0
    while 2 * (layers) * s["layer"] + 2 * (s["root"] / 2) < reuse and layers < 10_000:
        layers += 1
    layers = min(layers, 10_000)
    return min(s["params"], layers * s["layer"] + s["root"] / 2 + min(prefetch, s["layer"]))


def planned_load(config: Path) -> dict:
    from shardwise.config.load import load_config
    from shardwise.run.bridge import run_spec
    from shardwise.train.model.weights import planned_load as load

    p = load(run_spec(load_config(config), RANKS, "cpu"))
    return {"per_rank": p.per_rank, "resident": p.resident, "read": p.read, "process": p.process, "path": p.path}


def checkpoint_record(ckpt: Path) -> dict:
    """What the planner reads of a checkpoint before any rank starts: config.json, the index and
    each weights file's size (so the plan can be recomputed without the weights)."""
    files = {f.name: f.stat().st_size for f in sorted(ckpt.glob("*.safetensors"))}
    return {"config": json.loads((ckpt / "config.json").read_text()),
            "index": json.loads((ckpt / "model.safetensors.index.json").read_text()), "files": files}


def planned(case: dict) -> dict:
    """The trainer's own plan of this case's run on this code (shardwise.train.host_memory
    planned_cpu, as its preflight and summary use it), on a stand-in of the checkpoint: its
    config.json and index, and each weights file as a sparse file of its size."""
    import yaml

    from shardwise.config.load import load_config
    from shardwise.run.bridge import run_spec
    from shardwise.train.host_memory import planned_cpu

    with tempfile.TemporaryDirectory(prefix="host-memory-plan-") as tmp:
        cfg = yaml.safe_load(case["config_yaml"])
        if "checkpoint" in case:
            d = Path(tmp) / "checkpoint"
            d.mkdir()
            (d / "config.json").write_text(json.dumps(case["checkpoint"]["config"]))
            (d / "model.safetensors.index.json").write_text(json.dumps(case["checkpoint"]["index"]))
            for name, size in case["checkpoint"]["files"].items():
                with open(d / name, "wb") as f:
                    f.truncate(size)
            cfg["model"]["path"] = str(d)
        cfg["checkpointing"]["output_dir"] = str(Path(tmp) / "out")
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return planned_cpu(run_spec(load_config(path), RANKS, "cpu")).as_dict()


def phases(directory: Path) -> dict[str, list[dict]]:
    out = {}
    for f in sorted(directory.glob("rank*.jsonl")):
        out[f.stem] = [json.loads(line) for line in f.read_text().splitlines()]
    return out


def summarise(ph: list[dict]) -> dict:
    """One rank's phases as the model's measured terms: `steady_rss` is the RSS after its last
    optimizer step (model states, buffers, the heap the steps left), `train_peak` the peak from
    the end of the load to the loop's return (the probe resets VmHWM once loaded)."""
    by = {r["phase"]: r for r in ph}
    start, loaded, last = by["start"], by["loaded"], ph[-1]
    steady = by.get("step", last)
    return {
        "start_rss": start["VmRSS"], "loaded_rss": loaded["VmRSS"], "load_peak": loaded["VmHWM"],
        "train_peak": last["VmHWM"], "steady_rss": steady["VmRSS"],
        "states_measured": steady["VmRSS"] - start["VmRSS"],
        "load_transient": loaded["VmHWM"] - loaded["VmRSS"],
        "train_growth": last["VmHWM"] - loaded["VmRSS"],
        "heap_free_after_step": steady.get("heap_free"),
    }


def measure(name: str, cache: Path, steps: int, cap: int | None) -> dict:
    strategy, mode, model = CASES[name]
    ckpt = checkpoint(cache, model) if mode != "demo" else None
    env = child_env()
    with tempfile.TemporaryDirectory(prefix="host-memory-") as tmp:
        tmp_path = Path(tmp)
        config = write_config(tmp_path, ckpt, strategy, mode, steps)
        (tmp_path / "phases").mkdir()
        env["SHARDWISE_HOST_PHASES_DIR"] = str(tmp_path / "phases")
        job = run_in_cgroup([sys.executable, "-m", "shardwise.train.cli", str(config)], env,
                            f"shardwise-host-memory-{os.getpid()}-{name}", cap)
        metrics = tmp_path / "out" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        rank0_peak = max((r["memory_bytes"] for r in rows if "memory_bytes" in r), default=None)
        ph = phases(tmp_path / "phases")
        load = planned_load(config)
        config_yaml = config.read_text()
    s = shapes(ckpt) if ckpt is not None else {}
    terms = model_terms(strategy, mode, s) if ckpt is not None else {"states": {}, "gathered": {}}
    ranks = {k: summarise(v) for k, v in ph.items() if any(r["phase"] == "loaded" for r in v)}
    losses = [r.get("loss") for r in rows if "loss" in r]
    return {"case": name, "strategy": strategy, "mode": mode, "model": model, "ranks": RANKS, "seq": SEQ,
            "config_yaml": config_yaml, **({"checkpoint": checkpoint_record(ckpt)} if ckpt is not None else {}),
            "steps": steps, "shapes": s, "terms": terms,
            "terms_total": {k: sum(v.values()) for k, v in terms.items()},
            "planned_load": load, "job": {k: v for k, v in job.items() if k != "output_tail"},
            "rank0_peak_rss_metrics": rank0_peak, "per_rank": ranks, "phases": ph, "losses": losses,
            "output_tail": job["output_tail"] if job["rc"] != 0 else ""}


def table(doc: dict) -> str:
    """Markdown: per case, the model's terms beside what they predict, per rank (GiB; the worst
    rank), and the job's cgroup peak. `states` is measured as the RSS after the last step over
    the RSS at start (model states, buffers, the heap the step left); `gathered + transient` as
    the training's peak over the RSS after the last step; the load's peak over the RSS once
    loaded is the read in flight (planned: shardwise.plan.load `read`)."""
    g = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    base = doc["baseline"]
    fork = base.get("forked", {})
    forked = (f"; forked from the launcher, right after the fork: {g(fork['torch_engines']['VmRSS'])} and "
              f"{g(fork['deepspeed']['VmRSS'])} GiB" if fork else "")
    lines = [f"Process baseline (VmRSS once imported): torch engines {g(base['torch_engines']['VmRSS'])} GiB, "
             f"DeepSpeed {g(base['deepspeed']['VmRSS'])} GiB{forked}; a rank at start (before building): see `start`.",
             "",
             "| case | start | states (model) | states (measured) | gathered+transient (model) | (measured) "
             "| load read (plan) | (measured) | peak per rank | job peak (cgroup) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in doc["cases"].items():
        c["per_rank"] = {k: summarise(v) for k, v in c["phases"].items() if any(r["phase"] == "loaded" for r in v)}
        if not c["per_rank"]:
            lines.append(f"| {name} | failed (rc {c['job']['rc']}) |||||||||")
            continue
        worst = max(c["per_rank"].values(), key=lambda r: max(r["train_peak"], r["load_peak"]))
        lines.append(
            f"| {name} | {g(worst['start_rss'])} | {g(c['terms_total']['states'])} | "
            f"{g(worst['steady_rss'] - worst['start_rss'])} | {g(c['terms_total']['gathered'])} | "
            f"{g(worst['train_peak'] - worst['steady_rss'])} | {g(c['planned_load']['read'])} | "
            f"{g(worst['load_peak'] - worst['loaded_rss'])} | {g(max(worst['train_peak'], worst['load_peak']))} | "
            f"{g(c['job']['cgroup_peak'])} |")
    return "\n".join(lines)


# The cases planned against: the README's demo on each engine, LoRA of the 1.36B Llama (fsdp,
# zero3, ddp) and full fine-tuning of the 374M (fsdp, zero2). The heap term of the plan
# (catalog/memory.yaml heap_floor_bytes) was read off the demo's and the 1.36B/134M cases'
# heaps; the process terms off a fresh interpreter (`baseline`); the rest of the plan is the GPU
# planner's.
ACCURACY_CASES = ("demo-ddp", "demo-zero2", "demo-zero3", "demo-fsdp", "fsdp-lora-1.36b", "zero3-lora-1.36b",
                  "ddp-lora-1.36b", "fsdp-full-374m", "zero2-full-374m")
TOLERANCE = 0.15


def measured_peak(case: dict) -> tuple[float, float, float]:
    """The fullest rank's peak RSS over the whole run, the larger of its load's and its
    training's (the probe resets VmHWM in between), and those two."""
    ranks = [summarise(v) for v in case["phases"].values() if any(r["phase"] == "loaded" for r in v)]
    worst = max(ranks, key=lambda r: max(r["load_peak"], r["train_peak"]))
    return max(worst["load_peak"], worst["train_peak"]), worst["load_peak"], worst["train_peak"]


def accuracy(doc: dict) -> list[dict]:
    """Per case of ACCURACY_CASES and then the others measured: planned vs measured peak per rank."""
    names = [*ACCURACY_CASES, *(n for n in doc["cases"] if n not in ACCURACY_CASES)]
    rows = []
    for name in names:
        c = doc["cases"][name]
        plan = planned(c)
        m, load, train = measured_peak(c)
        rows.append({"case": name, "measured": m, "measured_load": load, "measured_training": train, "planned": plan["peak"], "phase": plan["phase"],
                     "error": plan["peak"] / m - 1, "process": plan["process"], "tensors": plan["allocated"],
                     "heap": plan["heap_slack"], "load": plan["load"]["per_rank"], "checked": name in ACCURACY_CASES})
    return rows


def accuracy_table(doc: dict) -> str:
    """Markdown: planned vs measured peak RSS per rank (GiB), the plan's terms, the error."""
    g = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    lines = ["| case | measured peak/rank (load / training) | planned | error "
             "| planned: process + tensors + heap (load) |",
             "|---|---|---|---|---|"]
    for r in accuracy(doc):
        terms = f"{g(r['process'])} + {g(r['tensors'])} + {g(r['heap'])} ({g(r['load'])})"
        name = r["case"] if r["checked"] else f"{r['case']} (not in the 15% set)"
        lines.append(f"| {name} | {g(r['measured'])} ({g(r['measured_load'])} / {g(r['measured_training'])}) | "
                     f"{g(r['planned'])} ({r['phase']}) | {r['error']:+.0%} | {terms} |")
    return "\n".join(lines)


EXPORT_CASES = ("fsdp-lora-1.36b", "zero3-lora-1.36b", "ddp-lora-1.36b", "fsdp-full-374m", "zero2-full-374m")


def export_check(name: str, cache: Path, steps: int) -> dict:
    """The case run again with its end-of-run export (`save_final: true`, a checkpoint at the last
    step; full fine-tuning exports fp32 so that the export and the checkpoint's fp32 weights can
    be compared exactly), then the export loaded as a user loads it (LoRA: PeftModel on the base;
    full: AutoModelForCausalLM) and its fp32 logits on 16 tokens compared with the checkpoint's:
    the base with the checkpoint's adapters injected by PEFT, or a model filled with the
    checkpoint's tensors."""
    import gc

    import torch
    import yaml
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardwise.train.checkpoint.directory import checkpoints_dir, step_dir_name
    from shardwise.train.checkpoint.sharded import read_tensors, tensor_shapes

    strategy, mode, model = CASES[name]
    ckpt = checkpoint(cache, model)
    with tempfile.TemporaryDirectory(prefix="host-memory-export-") as tmp:
        tmp_path = Path(tmp)
        config = write_config(tmp_path, ckpt, strategy, mode, steps)
        cfg = yaml.safe_load(config.read_text())
        cfg["checkpointing"].update(save_final=True, save_every_steps=steps, save_every_minutes=None)
        if mode == "full":
            cfg["export"] = {"dtype": "fp32"}
        config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        t0 = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "shardwise.train.cli", str(config)], env=child_env(), cwd=ROOT,
                             capture_output=True, text=True, check=False)
        out = {"case": name, "rc": run.returncode, "wall_s": round(time.monotonic() - t0, 1)}
        if run.returncode != 0:
            return out | {"output_tail": (run.stdout + run.stderr)[-3000:]}
        run_dir = tmp_path / "out"
        step = checkpoints_dir(run_dir) / step_dir_name(steps)
        keys = [k for k in tensor_shapes(step) if k.startswith("model.")]
        saved = {k.removeprefix("model."): v.float() for k, v in read_tensors(step, keys).items()}
        ids = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(0))
        if mode == "lora":
            from peft import LoraConfig, PeftModel, inject_adapter_in_model

            ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
            ref = inject_adapter_in_model(LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"],
                                                     target_modules=LORA["target_modules"]), ref)
            ref.load_state_dict(saved, strict=False)
            with torch.no_grad():
                want = ref(ids).logits
            del ref
            gc.collect()
            got_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32),
                                                  run_dir / "model").eval()
            trained = max(float(v.abs().max()) for k, v in saved.items() if "lora_B" in k)
        else:
            ref = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt), dtype=torch.float32).eval()
            missing, unexpected = ref.load_state_dict(saved, strict=False)
            assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
            with torch.no_grad():
                want = ref(ids).logits
            del ref
            gc.collect()
            got_model = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32).eval()
            trained = None
        with torch.no_grad():
            got = got_model(ids).logits
        summary = json.loads((run_dir / "summary.json").read_text())
        return out | {"export": summary.get("export"), "max_abs_logit_diff": float((got - want).abs().max()),
                      "lora_B_max": trained, "summary_peak_rss": summary.get("measured_memory_bytes"),
                      "summary_planned": summary.get("planned_host_bytes")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "shardwise-checkpoints")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--cap-gib", type=float, default=None, help="memory.limit_in_bytes of each job's cgroup")
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    ap.add_argument("--accuracy", action="store_true", help="print planned vs measured (docs/training.md) and exit")
    ap.add_argument("--export-check", action="store_true",
                    help=f"run {', '.join(EXPORT_CASES)} with their export and compare its logits with the checkpoint's")
    a = ap.parse_args()
    if a.table:
        print(table(json.loads(a.out.read_text())))
        return
    if a.accuracy:
        print(accuracy_table(json.loads(a.out.read_text())))
        return
    if not (CGROUP / "cgroup.procs").exists():
        sys.exit(f"{CGROUP}: no cgroup v1 memory controller here (the benchmark needs one, and root)")
    names = [c.strip() for c in a.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    doc = json.loads(a.out.read_text()) if a.out.exists() else {}
    if a.export_check:
        doc.setdefault("export_check", {})
        for name in [n for n in names if n in EXPORT_CASES] if a.cases != ",".join(CASES) else EXPORT_CASES:
            row = export_check(name, a.cache, a.steps)
            doc["export_check"][name] = row
            print(f"{name}: {row}", flush=True)
            a.out.write_text(json.dumps(doc, indent=1) + "\n")
        return
    doc["baseline"] = baseline(child_env())
    doc.setdefault("cases", {})
    cap = int(a.cap_gib * GIB) if a.cap_gib else None
    for name in names:
        row = measure(name, a.cache, a.steps, cap)
        doc["cases"][name] = row
        per = row["per_rank"].get("rank0", {})
        print(f"{name}: rc {row['job']['rc']}, job peak {row['job']['cgroup_peak'] / GIB:.2f} GiB, "
              f"largest process {row['job']['largest_process_peak_rss'] / GIB:.2f} GiB, rank0 start "
              f"{per.get('start_rss', 0) / GIB:.2f} loaded {per.get('loaded_rss', 0) / GIB:.2f} "
              f"load peak {per.get('load_peak', 0) / GIB:.2f} train peak {per.get('train_peak', 0) / GIB:.2f}; "
              f"model states {row['terms_total']['states'] / GIB:.2f} + gathered "
              f"{row['terms_total']['gathered'] / GIB:.2f} GiB", flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
