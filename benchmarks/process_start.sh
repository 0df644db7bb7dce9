#!/usr/bin/env bash
# What a process costs before and after its work (BENCHMARKS.md, "Process start and exit"), from a
# clone's root with the venv active: a 4-step tiny pretraining run (the tests' tiny_config, 16-px
# digits) in one process with the command's gc.freeze at exit (as shipped) and with it
# unregistered; then the same run on 2 ranks through the `deepspeed` runner and through
# DeepSpeed's per-node launcher alone (what the runner runs on one node). ROUNDS interleaved
# rounds; wall and user+sys CPU seconds per run, then the medians. Last, what a rank imports before
# its first step, stage by stage (each a fresh interpreter): torch; DeepSpeed and mpp's command;
# torch._dynamo, which torch.optim's first optimizer imports; torch._inductor, which DeepSpeed's
# check for its Muon optimizer imports at deepspeed.initialize under ZeRO 1-3.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
ROUNDS=${ROUNDS:-3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python - "$TMP" <<'PY'
import json, sys
sys.path.insert(0, "tests")
from conftest import tiny_config
from mpp.data import digits_shards
tmp = sys.argv[1]
json.dump(tiny_config(digits_shards(img_size=16, cache_dir=tmp)), open(f"{tmp}/cfg.json", "w"))
PY
report() {  # $1: the row's name; a run that wrote no encoder failed: said, not timed
  if [ ! -f "$TMP/run/encoder.safetensors" ]; then echo "$1: FAILED"; tail -5 "$TMP/err"; return; fi
  tail -1 "$TMP/err" | awk -v m="$1" '{printf "%s\t%.1f\t%.1f\n", m, $1, $2 + $3}' | tee -a "$TMP/rows"
}
one() {  # $1: freeze | plain
  local pre="import mpp.commands"
  [ "$1" = plain ] && pre="import atexit, gc, mpp.commands; atexit.unregister(gc.freeze)"
  rm -rf "$TMP/run"
  /usr/bin/time -f "%e %U %S" python -c "$pre
import runpy, sys
sys.argv = ['pretrain/run.py', '--config', '$TMP/cfg.json', '--output-dir', '$TMP/run']
runpy.run_path('pretrain/run.py', run_name='__main__')" > /dev/null 2> "$TMP/err" || true
  report "1 process, $1"
}
two() {  # $1: runner | launch.py
  local port world head
  port=$(python -c "from mpp.parallel.launch import free_port; print(free_port())")
  world=$(python -c "import base64, json; print(base64.urlsafe_b64encode(json.dumps({'localhost': [0, 1]}).encode()).decode())")
  if [ "$1" = runner ]; then head=(deepspeed --num_gpus 2 --master_port "$port")
  else head=(env "PYTHONPATH=$PWD" python -u -m deepspeed.launcher.launch "--world_info=$world" --master_addr 127.0.0.1 --master_port "$port"); fi
  rm -rf "$TMP/run"
  /usr/bin/time -f "%e %U %S" "${head[@]}" pretrain/run.py --config "$TMP/cfg.json" --output-dir "$TMP/run" > /dev/null 2> "$TMP/err" || true
  report "2 ranks, $1"
}
imports() {  # $1: the row's name, $2: the modules; a failed import is said, not timed
  if ! /usr/bin/time -f "%e %U %S" python -c "import $2" > /dev/null 2> "$TMP/err"; then
    echo "$1: FAILED"; tail -5 "$TMP/err"; return
  fi
  tail -1 "$TMP/err" | awk -v m="$1" '{printf "%s\t%.1f\t%.1f\n", m, $1, $2 + $3}' | tee -a "$TMP/rows"
}
STAGES=(torch "deepspeed, mpp.commands.pretrain" torch._dynamo deepspeed.runtime.zero.muon.muon_optimizer)
for _ in $(seq "$ROUNDS"); do
  one freeze; one plain; two runner; two launch.py
  mods=""
  for m in "${STAGES[@]}"; do mods="${mods:+$mods, }$m"; imports "imports up to $m" "$mods"; done
done
echo "medians (wall / cpu s):"
python - "$TMP/rows" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name, wall, cpu = line.rstrip("\n").split("\t")
    rows.setdefault(name, []).append((float(wall), float(cpu)))
for name, runs in rows.items():
    wall, cpu = (statistics.median(x) for x in zip(*runs))
    print(f"  {name:<62} {wall:5.1f} / {cpu:5.1f}  ({len(runs)} runs)")
PY
