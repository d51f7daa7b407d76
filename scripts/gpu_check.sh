#!/usr/bin/env bash
# The NCCL path and the LM example on a GPU machine without Ray (the device tool's
# machines have torch, not Ray): scripts/gpu_check.py under torchrun, then examples/llm.py
# under torchrun on the GPU(s) (model preset base, bf16, dp_shard over the GPUs). Logs go to
# $OUT (or ./gpu_out). Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out="${OUT:-gpu_out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=4
n=$(python -c "import torch; print(torch.cuda.device_count())")
{ nvidia-smi -L; python -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"; } 2>&1 | tee "$out/env.txt"
timeout 150 torchrun --standalone --nproc-per-node "$n" scripts/gpu_check.py 2>&1 | tee "$out/gpu_check.log"
rc1=${PIPESTATUS[0]}
job="$out/llm_gpu.yaml"
python - "$job" <<'PY'
import sys, yaml
job = yaml.safe_load(open("examples/llm.yaml"))
job["mesh"] = {"dp_replicate": 1, "dp_shard": -1}
yaml.safe_dump(job, open(sys.argv[1], "w"))
PY
cfg='{"model": {"preset": "base", "max_seq_len": 256}, "mixed_precision": "bf16", "steps": 300, "report_every": 50, "eval_every": 300, "checkpoint_every": 0, "check_peer_batches": 0, "data": {"batch_size": 32, "max_tokens": 4000000}}'
timeout 240 torchrun --standalone --nproc-per-node "$n" examples/llm.py "$job" --config "$cfg" 2>&1 | tee "$out/llm_gpu.log"
rc2=${PIPESTATUS[0]}
echo "gpu_check rc=$rc1 llm rc=$rc2" | tee "$out/rc.txt"
[ "$rc1" = 0 ] && [ "$rc2" = 0 ]
