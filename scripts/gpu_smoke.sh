#!/usr/bin/env bash
# make gpu-smoke: the GPU checks as one short run. env and bandwidth on every GPU present,
# lr_find, then train ddp and zero3 on one GPU in bf16, printing throughput and MFU.
# Uses .venv when there is one (make setup), else the python on PATH (a CUDA image's torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-outputs/gpu-smoke}
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -lt 1 ]; then
  echo "gpu-smoke: no CUDA device visible; nothing to check" >&2
  exit 1
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name(0))"
common=(tracking=none "cache_dir=$OUT/cache" model=gpt-small data=markov data.num_samples=2048
        lr_find.num_iters=40 train.steps=30 train.micro_batch=8 train.log_every=10 strategy.precision=bf16)
# Every GPU: the fleet check and the collective probe up to 1 GiB.
"$PY" run.py "${common[@]}" nodes=1 procs_per_node="$gpus" only=[bandwidth] \
  bandwidth.max_bytes=1073741824 bandwidth.factor=4 "hydra.run.dir=$OUT/bandwidth"
for strategy in ddp zero3; do
  "$PY" run.py "${common[@]}" nodes=1 procs_per_node=1 strategy=$strategy only=[train] \
    "hydra.run.dir=$OUT/train-$strategy"
done
"$PY" - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
bw = json.loads((out / "bandwidth/summary.json").read_text())["stages"]["bandwidth"]["result"]
print("bandwidth:", bw["verdict"])
for s in ("ddp", "zero3"):
    t = json.loads((out / f"train-{s}/summary.json").read_text())["stages"]["train"]["result"]
    mfu = "n/a" if t["mfu_pct"] is None else f"{t['mfu_pct']:.1f} %"
    print(f"train {s}: {t['tokens_per_s']:.0f} tokens/s, step {t['step_time_s']*1e3:.1f} ms, MFU {mfu}, "
          f"peak {t['peak_memory_bytes']/2**30:.2f} GiB ({t['memory_source']}), loss {t['losses'][0]:.3f} -> {t['final_loss']:.3f}")
PY
