"""Launch scripts for emitted configs: torchrun, the deepspeed launcher, accelerate and SLURM.

Every script runs shardwise's trainer (`python -m shardwise.train.cli CONFIG`: the trainer's
Typer app has a single command, so there is no `train` word after the module) on the
emitted `shardwise.yaml`. Node/port values default to the plan and can be overridden from the
environment, so the same file serves every node of a multi-node job.
"""

from __future__ import annotations

from shardwise.emit.accelerate import DS_HF_FILE, MIXED_PRECISION
from shardwise.specs import HardwareSpec, ParallelLayout, Strategy, TrainSpec

TRAINER = "shardwise.train.cli"
CPUS_PER_GPU = 8  # a common allotment; DeepSpeed CPU Adam (offload) wants more

_HEADER = """#!/usr/bin/env bash
# {title}
# Planned: {strategy} on {nodes} node(s) x {gpus} GPU(s) ({gpu}).
# Activation checkpointing is the model's job, not the launcher's: shardwise.yaml sets
# checkpointing.activation={ckpt}; in an HF Trainer script use gradient_checkpointing=True
# (or model.gradient_checkpointing_enable()).
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
"""


def planned(strategy: Strategy, hw: HardwareSpec) -> str:
    """The strategy with its model-parallel layout, as the scripts' comments name it:
    `fsdp tp 4 × pp 4 (1f1b) × dp 4` (the name alone without TP or PP)."""
    if strategy.tp == 1 and strategy.pp == 1 and strategy.cp == 1:
        return strategy.name
    lay = ParallelLayout.for_strategy(strategy, hw.world_size, hw.gpus_per_node)
    schedule = strategy.pp_schedule + (f", {strategy.pp_virtual_stages} stages a rank"
                                       if strategy.pp_virtual_stages > 1 else "")
    return (f"{strategy.name} " + (f"tp {lay.tp} × " if lay.tp > 1 else "")
            + (f"pp {lay.pp} ({schedule}) × " if lay.pp > 1 else "") + f"dp {lay.dp}"
            + (f" (cp {lay.cp}, {strategy.cp_scheme})" if lay.cp > 1 else ""))


def _header(title: str, hw: HardwareSpec, train: TrainSpec, strategy: Strategy) -> str:
    return _HEADER.format(title=title, strategy=planned(strategy, hw), nodes=hw.nodes, gpus=hw.gpus_per_node,
                          gpu=hw.gpu.name, ckpt=train.checkpointing)  # fmt: skip


def torchrun_script(hw: HardwareSpec, train: TrainSpec, strategy: Strategy) -> str:
    return _header("torchrun: run once on every node (same MASTER_ADDR/MASTER_PORT on all).", hw, train, strategy) + f"""
NNODES="${{NNODES:-{hw.nodes}}}"
NPROC_PER_NODE="${{NPROC_PER_NODE:-{hw.gpus_per_node}}}"
MASTER_ADDR="${{MASTER_ADDR:-127.0.0.1}}"  # node 0's address on multi-node runs
MASTER_PORT="${{MASTER_PORT:-29500}}"

exec torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \\
  --rdzv-id "${{RDZV_ID:-shardwise}}" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \\
  -m {TRAINER} "$HERE/shardwise.yaml" "$@"
"""


def deepspeed_script(hw: HardwareSpec, train: TrainSpec, strategy: Strategy) -> str:
    return _header("deepspeed launcher: run on node 0 only; it starts the ranks on every node.", hw, train, strategy) + f"""#
# Multi-node: HOSTFILE lists one node per line as "hostname slots={hw.gpus_per_node}", and node 0
# needs passwordless ssh (pdsh) to the others. One node needs no hostfile.
# The trainer builds its DeepSpeed config from shardwise.yaml; ds_config.json is the same
# settings for your own script: deepspeed your_train.py --deepspeed_config "$HERE/ds_config.json".
NUM_NODES="${{NUM_NODES:-{hw.nodes}}}"
NUM_GPUS="${{NUM_GPUS:-{hw.gpus_per_node}}}"
MASTER_ADDR="${{MASTER_ADDR:-127.0.0.1}}"
MASTER_PORT="${{MASTER_PORT:-29500}}"
HOSTFILE="${{HOSTFILE:-$HERE/hostfile}}"

args=(--num_nodes "$NUM_NODES" --num_gpus "$NUM_GPUS" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
if [ "$NUM_NODES" -gt 1 ]; then
  args+=(--hostfile "$HOSTFILE")
fi
# --no_local_rank: the trainer reads LOCAL_RANK from the environment and takes no --local_rank flag.
exec deepspeed "${{args[@]}}" --no_local_rank --module {TRAINER} "$HERE/shardwise.yaml" "$@"
"""


def accelerate_script(hw: HardwareSpec, train: TrainSpec, strategy: Strategy) -> str:
    # DeepSpeed: precision must come from the command line, not accelerate.yaml (see emit/accelerate.py).
    mp = f" --mixed_precision {MIXED_PRECISION[train.precision]}" if strategy.engine == "deepspeed" else ""
    # accelerate.yaml names ds_config_hf.json relative to the launch directory: the path beside
    # this script wins on the command line, wherever it is launched from
    if strategy.engine == "deepspeed":
        mp += f' --deepspeed_config_file "$HERE/{DS_HF_FILE}"'
    return _header("accelerate launch: run once on every node with its MACHINE_RANK.", hw, train, strategy) + f"""#
# No arguments: shardwise's trainer on shardwise.yaml. With arguments: your own script under
# accelerate.yaml, e.g. ./launch_accelerate.sh train_sft.py --bf16 ... (an HF Trainer script
# needs no --deepspeed here: accelerate.yaml already points at ds_config_hf.json).
NUM_MACHINES="${{NUM_MACHINES:-{hw.nodes}}}"
NUM_PROCESSES="${{NUM_PROCESSES:-{hw.world_size}}}"  # all machines together
MACHINE_RANK="${{MACHINE_RANK:-0}}"
MASTER_ADDR="${{MASTER_ADDR:-127.0.0.1}}"
MASTER_PORT="${{MASTER_PORT:-29500}}"

if [ "$#" -eq 0 ]; then
  set -- -m {TRAINER} "$HERE/shardwise.yaml"
fi
exec accelerate launch --config_file "$HERE/accelerate.yaml" \\
  --num_machines "$NUM_MACHINES" --num_processes "$NUM_PROCESSES" --machine_rank "$MACHINE_RANK" \\
  --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT"{mp} "$@"
"""


def slurm_script(hw: HardwareSpec, train: TrainSpec, strategy: Strategy) -> str:
    """sbatch runs a copy of the script from its spool directory, so the emitted directory is
    found at run time (no path is baked in): EMIT_DIR, else the directory of the script as
    submitted (`scontrol show job`'s Command), else the submit directory."""
    cpus = CPUS_PER_GPU * hw.gpus_per_node
    return f"""#!/usr/bin/env bash
#SBATCH --job-name=shardwise-{strategy.name.replace("+", "-")}
#SBATCH --nodes={hw.nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={hw.gpus_per_node}
#SBATCH --cpus-per-task={cpus}
#SBATCH --output=%x-%j.out
# One task per node runs torchrun, which starts {hw.gpus_per_node} ranks there; rank 0's node is the
# rendezvous. Planned: {planned(strategy, hw)} on {hw.nodes} node(s) x {hw.gpus_per_node} GPU(s) ({hw.gpu.name}).
# Activation checkpointing: set in shardwise.yaml (checkpointing.activation={train.checkpointing}).
# Activate the environment that has shardwise installed before `sbatch`, or here.
# The emitted directory: EMIT_DIR, else where this script was submitted from (sbatch runs a copy).
set -euo pipefail
if [ -z "${{EMIT_DIR:-}}" ]; then
  submitted="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *Command=//p' | head -n 1)"
  case "$submitted" in
    /*) EMIT_DIR="$(dirname "$submitted")" ;;
    ?*) EMIT_DIR="${{SLURM_SUBMIT_DIR:-.}}/$(dirname "$submitted")" ;;
    *) EMIT_DIR="${{SLURM_SUBMIT_DIR:-.}}" ;;
  esac
fi
if [ ! -f "$EMIT_DIR/shardwise.yaml" ]; then
  echo "slurm.sbatch: no shardwise.yaml in $EMIT_DIR: set EMIT_DIR=/path/to/the/emitted/directory" >&2
  exit 2
fi

MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT="${{MASTER_PORT:-29500}}"
export MASTER_ADDR MASTER_PORT
threads=$(( ${{SLURM_CPUS_PER_TASK:-{cpus}}} / {hw.gpus_per_node} ))
export OMP_NUM_THREADS="$(( threads > 0 ? threads : 1 ))"

srun --kill-on-bad-exit=1 torchrun \\
  --nnodes "$SLURM_NNODES" --nproc-per-node {hw.gpus_per_node} \\
  --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \\
  -m {TRAINER} "$EMIT_DIR/shardwise.yaml" "$@"
"""


def launch_scripts(hw: HardwareSpec, train: TrainSpec, strategy: Strategy) -> dict[str, str]:
    """File name -> script text; the deepspeed launcher only for DeepSpeed strategies."""
    out = {"launch_torchrun.sh": torchrun_script(hw, train, strategy)}
    if strategy.engine == "deepspeed":
        out["launch_deepspeed.sh"] = deepspeed_script(hw, train, strategy)
    out["launch_accelerate.sh"] = accelerate_script(hw, train, strategy)
    out["slurm.sbatch"] = slurm_script(hw, train, strategy)
    return out
