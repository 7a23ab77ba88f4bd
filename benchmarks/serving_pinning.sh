#!/bin/bash
# Does pinning keep the mesh's services off the worker's cores? A 32-stream burst (`vmesh bench
# serving --workload medium --request-rate 0 --max-concurrency 32`) against one running
# `vmesh serve --weights int8 --dtype bfloat16`, after a warm-up run that leaves every prompt in the
# prefix cache (so the rounds are decode steps at 32 streams), in three placements, alternated:
#   A  nothing pinned (the default);
#   B  frontend, scheduler, detokenizer and the load generator on CPU 1;
#   C  as B, and the worker's two busiest threads (its OpenMP team) one on each CPU.
# Usage, from the repository root on a 2-CPU machine: benchmarks/serving_pinning.sh [ROUNDS]
set -euo pipefail
rounds=${1:-3}
out=$(mktemp -d)
vmesh=${VMESH:-.venv/bin/vmesh}
$vmesh serve --weights int8 --dtype bfloat16 --port 0 --http-port 0 > "$out/serve.log" 2>&1 &
serve=$!
trap 'kill -INT $serve 2>/dev/null; wait $serve 2>/dev/null || true' EXIT
for _ in $(seq 120); do grep -q "serving on" "$out/serve.log" && break; sleep 1; done
address=$(grep -o "serving on [0-9.:]*" "$out/serve.log" | awk '{print $3}')
worker=$(pgrep -P $serve -f " worker " | head -1)
services=$(pgrep -P $serve | grep -v "^$worker\$")
unpin() { for p in $worker $services; do taskset -a -p -c 0,1 "$p" > /dev/null; done; }
run() {  # placement, the load generator's CPUs, round
  taskset -c "$2" $vmesh bench serving --address "$address" --workload medium --request-rate 0 --max-concurrency 32 \
      --out "$out/$1-$3" > "$out/$1-$3.log" 2>&1
  { grep -E "tokens/s|tpot_ms" "$out/$1-$3.log" | tr "\n" " "; echo; } | sed "s/^/$1 round $3: /"
}
unpin; run warm-up 0,1 0
for r in $(seq "$rounds"); do
  unpin; run A 0,1 "$r"
  for p in $services; do taskset -a -p -c 1 "$p" > /dev/null; done; run B 1 "$r"
  read -r -a busiest <<< "$(ps -L -o tid=,time= -p "$worker" | sort -k2 -r | head -2 | awk '{print $1}' | tr '\n' ' ')"
  taskset -p -c 0 "${busiest[0]}" > /dev/null; taskset -p -c 1 "${busiest[1]}" > /dev/null; run C 1 "$r"
done
unpin
