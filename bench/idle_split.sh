#!/usr/bin/env bash
# Measurement only (root): N paced sessions held, then the USS of each
# session's processes (bench/uss_of.py), optionally again after a pause.
#   bench/idle_split.sh N [SECOND_READ_AFTER_S]
#   TREE=/path/to/other/checkout bench/idle_split.sh N ...   its daemon instead (A/B)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "${TREE:-$here}"
n=${1:-12}; again=${2:-0}
pidfile=/tmp/idle3-$$.pids
rm -f "$pidfile"; log=/tmp/idle3-$$.log
./scripts/bench --density "$n" --pace 0.1 --hold $((again + 8)) --pidfile "$pidfile" >"$log" 2>&1 &
bench=$!
for _ in $(seq 600); do [ -s "$pidfile" ] && break; sleep 0.2; done
sleep 1
/tmp/rootvenv/bin/python "$here/bench/uss_of.py" "$pidfile" | tail -20
if [ "$again" != 0 ]; then echo "second processes killed:"; /tmp/rootvenv/bin/python "$here/bench/uss_of.py" "$pidfile" --kill-children | tail -20; fi
wait "$bench" || true
grep -E "failed|USS|processes|D step|Traceback|Error" "$log" | head -5
rm -f "$pidfile" "$log"
