#!/usr/bin/env bash
# One GPU command running `tileq bench` (and/or `tileq demo`) with the H200 machine's own python3
# (torch 2.11, Triton 3.6; PYTHONPATH=src, no install). Each argument is one run's options:
#   bash scripts/bench_h200.sh "bench --suite smoke --runs 20" "bench --suite llm" "demo"
# Output folders go under /tmp/tileq-bench/<i>-<first suite or command>; after every run they
# are packed into $OUT/bench.tgz (the device tool returns at most 8 files), so a run cut short by
# the command's time limit still brings back what finished.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
OUT="${OUT:-/tmp/tileq-out}"
WORK=/tmp/tileq-bench
mkdir -p "$OUT" "$WORK"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
python3 -c "import matplotlib" 2>/dev/null || echo "matplotlib missing: plots are skipped (render them later with: tileq bench --render DIR)"
status=0
i=0
for spec in "$@"; do
  i=$((i + 1))
  read -r -a words <<< "$spec"
  label=$(printf '%s\n' "${words[@]}" | grep -v '^-' | sed -n 2p)
  [ -z "$label" ] && label="${words[0]}"
  dir="$WORK/$i-$(basename "$label" .csv)"
  t0=$(date +%s)
  python3 -m tileq "${words[@]}" --out "$dir" 2>&1 | tee "$WORK/$i.log" | tail -60
  rc=${PIPESTATUS[0]}
  cp "$WORK/$i.log" "$dir/" 2>/dev/null
  echo "== run $i ($spec): rc=$rc, $(( $(date +%s) - t0 )) s"
  [ "$rc" -ne 0 ] && status=$rc
  tar czf "$OUT/bench.tgz" -C "$WORK" .
done
exit $status
