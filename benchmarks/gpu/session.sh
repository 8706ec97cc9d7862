#!/usr/bin/env bash
# Run THERE, on one GPU, as one device call (about 9 minutes, 12 with the packed SFT case: split it over
# two calls if the lease allows less; timeout_s 600 each), after wheels.sh here:
#   run(command="bash benchmarks/gpu/session.sh", carry=[".whl"], timeout_s=600)
# Measures what only a GPU can, for issues #10, #12, #13 and #22, and leaves under $OUT (9 files):
#   gpu_throughput.json  the H200 trainer cases now vs 2026-11-30 (tokens/s, MFU, peak allocated;
#                        fsdp cases run as the plan chooses: DDP on one GPU where it fits and is no slower)
#   gpu_throughput_fully_shard.json  q05-fsdp kept on fully_shard
#   qlora.log            the QLoRA GPU test (qwen2.5-0.5b shape, 20 steps, loss and memory vs plan)
#   bench-q05.json/.md   shardwise bench: qwen2.5-0.5b under fsdp and zero3, predicted vs measured
#   profile.json         shardwise calibrate --quick: this GPU's rates
#   packed_sft.json      packed SFT of qwen2.5-0.5b on the bundled chat data (issue 22 item 2): the
#                        mask-free path (FlexAttention / flash-attn varlen) vs the dense mask, fp32 parity
#   memory_savers.json   each memory saver on qwen2.5-0.5b (step in backward, activation offloading,
#                        8/4-bit and paged AdamW, pure bf16, torchtune's 8B recipe): peak and tokens/s vs plan
#   session.log          everything printed
# Copy them to benchmarks/results/ here afterwards.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
step() { echo "== $1 ($(date +%T))"; }
step "trainer throughput: the cases the issue's targets name, then the rest while time allows"
timeout 300 python3 benchmarks/gpu_throughput.py --cases q05-fsdp,q05-ddp,l7b8-fsdp,l1b-fsdp,q05-zero3,q05-zero2,l7b8-zero3-ac \
    --out "$OUT/gpu_throughput.json"
step "q05-fsdp pinned to fully_shard (auto runs it as DDP on one GPU; l7b8-fsdp stays on fully_shard): FSDP2's own gain"
timeout 60 python3 benchmarks/gpu_throughput.py --cases q05-fsdp --fsdp-single-rank fsdp \
    --out "$OUT/gpu_throughput_fully_shard.json"
step "QLoRA on the GPU"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/train/test_qlora.py -k gpu > "$OUT/qlora.log" 2>&1; tail -3 "$OUT/qlora.log"
step "bench: qwen2.5-0.5b, fsdp and zero3"
cat > /tmp/q05.yaml <<'YAML'
name: bench-q05
model: {name: qwen2.5-0.5b}
data: {kind: synthetic, synthetic: {samples: 64, seq_len: 2048}}
precision: bf16-mixed
run: {steps: 6, micro_batch: 4, device: cuda, nproc: 1}
hardware: {gpu: h200}
logging: {progress: false, tensorboard: false}
YAML
timeout 150 python3 -m shardwise.cli bench /tmp/q05.yaml --steps 6 --out /tmp/bench-q05 --sweep strategy.name=fsdp,zero3 \
  && cp /tmp/bench-q05/bench.json "$OUT/bench-q05.json" && cp /tmp/bench-q05/report.md "$OUT/bench-q05.md"
step "packed SFT: qwen2.5-0.5b on the bundled chat data, rows of 2048, flex/varlen vs the dense mask"
timeout 200 python3 benchmarks/gpu/packed_sft.py --out "$OUT/packed_sft.json"
step "memory savers: qwen2.5-0.5b, one rank, each saver vs the baseline and the plan"
timeout 200 python3 benchmarks/gpu/memory_savers.py --out "$OUT/memory_savers.json"
step "calibrate"
timeout 60 python3 -m shardwise.cli calibrate --quick --out "$OUT/profile.json"
step "done"
