#!/usr/bin/env bash
# Time timing probes (tools/probe_tree.py) against the base tree, alternating, on the device machine.
# Usage: tools/probe_ab.sh "PROBE[,PROBE];PROBE..." "COMMAND" [ROUNDS]
#   Each ';'-separated entry is one probe tree (its ','-joined probes applied together). Every round runs COMMAND
#   (from the repository root of the tree it times, e.g. "python3 bench/decode.py --shapes 27b --formats nvfp4 --rows ''
#   --ttft 0") in the base tree, then in each probe tree. ROUNDS defaults to 2.
set -uo pipefail
cd "$(dirname "$0")/.."
here=$(pwd)
IFS=';' read -r -a trees <<< "$1"
cmd=$2
rounds=${3:-2}
work=$(mktemp -d /tmp/probes.XXXX)
for t in "${trees[@]}"; do
  python3 tools/probe_tree.py "$work/$t" "$t" || exit 1
done
# Compile every tree's kernels at once (NVRTC, ~70 s a tree, cached on disk by source hash), not one tree after
# another inside round 1: session 11, 5 trees in 72 s.
compile='from tandem.backend.cuda import loader; import pathlib
[loader.load_module(p.stem) for p in sorted(pathlib.Path("cuda").glob("*.cu"))]'
(cd "$here" && python3 -c "$compile") &
for t in "${trees[@]}"; do (cd "$work/$t" && python3 -c "$compile") & done
wait
for r in $(seq 1 "$rounds"); do
  echo "== base, round $r"
  (cd "$here" && eval "$cmd")
  for t in "${trees[@]}"; do
    echo "== probe $t, round $r"
    (cd "$work/$t" && eval "$cmd")
  done
done
rm -rf "$work"
