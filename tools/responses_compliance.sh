#!/usr/bin/env bash
# The Open Responses compliance suite (github.com/openresponses/openresponses, bin/compliance-test.ts over
# src/lib/compliance-tests.ts, at a pinned commit, its code unchanged) against `tandem serve` with
# --responses-events open-responses: the embedded model on the CPU unless arguments name another (they go to
# `tandem serve`), once with thinking on (at most TANDEM_COMPLIANCE_THINK tokens of it) and once with it off.
#
# The tests run one at a time (--filter, the suite's own option): the suite starts all of them at once, while one
# CPU engine serves one sequence at a time and the suite's WebSocket turns give up after 30 s.
# Needs bun (BUN_VERSION, from npm unless it is on PATH) and the suite (a checkout or a git directory holding the
# commit in OPENRESPONSES_DIR, else the commit's archive from GitHub); its one runtime dependency, zod, is
# installed at the version its bun.lock pins. Prints a line per test and a count per mode.
# The embedded model is an 18M-parameter toy tuned on synthetic chat and images: a sampled answer of it may still run
# until the context is full, or miss a tool under tool_choice auto, so a test can fail on what it writes, not on what
# the server sends; each test is reported as passed, model (its every error is of that kind), expected (listed in
# TANDEM_COMPLIANCE_EXPECTED_FAIL, space-separated ids; none by default) or failed (a response or event the spec
# refuses, a wrong status or error code).
# TANDEM_COMPLIANCE_SEED=N serves with --seed N (the seed of every request, none of which names one), so a run's
# sampled answers, and its verdicts, repeat; unset, each request draws a random seed.
# Exit status: 0 when no test failed, 1 otherwise, 77 when bun, the suite or zod cannot be had (no npm, no network).
set -euo pipefail
cd "$(dirname "$0")/.."
SUITE_COMMIT=92c12d96d7b61d6d15e2214daa5e9c6000ab6e1c
BUN_VERSION=1.3.5
ZOD_VERSION=3.25.76
expected_fail=" ${TANDEM_COMPLIANCE_EXPECTED_FAIL-} "
think=${TANDEM_COMPLIANCE_THINK:-32}
cache=${TANDEM_COMPLIANCE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem/openresponses-${SUITE_COMMIT:0:12}}
skip() { echo "responses_compliance: skipped: $*" >&2; exit 77; }
mkdir -p "$cache"

bun=$(command -v bun || true)
if [ -z "$bun" ] || [ "$("$bun" --version)" != "$BUN_VERSION" ]; then
  bun="$cache/bun/node_modules/.bin/bun"
  if [ ! -x "$bun" ]; then
    command -v npm >/dev/null || skip "no npm to install bun $BUN_VERSION"
    npm install -s --prefix "$cache/bun" "bun@$BUN_VERSION" >/dev/null 2>&1 || skip "npm could not install bun"
  fi
fi
suite="$cache/suite"
if [ ! -f "$suite/bin/compliance-test.ts" ]; then
  rm -rf "$suite.tmp" && mkdir -p "$suite.tmp"
  src=${OPENRESPONSES_DIR:-}
  if [ -n "$src" ] && [ -f "$src/bin/compliance-test.ts" ]; then
    cp -r "$src/bin" "$src/src" "$src/tsconfig.json" "$suite.tmp/"
  elif [ -n "$src" ]; then
    git --git-dir="$src" archive "$SUITE_COMMIT" bin src tsconfig.json | tar -x -C "$suite.tmp" \
      || skip "$src does not hold commit $SUITE_COMMIT"
  else
    curl -fsSL --max-time 120 "https://codeload.github.com/openresponses/openresponses/tar.gz/$SUITE_COMMIT" \
      | tar -xz -C "$suite.tmp" --strip-components=1 || skip "the suite could not be downloaded"
  fi
  echo '{"name": "openresponses-compliance", "private": true, "dependencies": {"zod": "'$ZOD_VERSION'"}}' \
    > "$suite.tmp/package.json"
  (cd "$suite.tmp" && "$bun" install --silent >/dev/null 2>&1) || skip "bun could not install zod $ZOD_VERSION"
  mv "$suite.tmp" "$suite"
fi
ids=$(cd "$suite" && "$bun" -e \
  'import {testTemplates} from "./src/lib/compliance-tests"; console.log(testTemplates.map(t => t.id).join(" "))')

# A test's verdict from its --json result: passed; expected (listed in TANDEM_COMPLIANCE_EXPECTED_FAIL); model (every
# error is the model's doing: an answer that did not end inside the context or the WebSocket turn's 30 s, no call
# chosen under tool_choice auto, or what the suite reports because such a turn gave it no response or left its
# continuation no room in the context); else failed.
classify='
import json, sys
MODEL = ("Expected status \"completed\" but got \"incomplete\"",
         "Timed out waiting for terminal WebSocket response event",
         "Expected output item of type \"function_call\" but none found")
AFTER = ("(root): Expected object, received null", "did not return a response id", "turn did not run",
         "but got status no terminal response", "but got no error code")
text, test_id, expected = sys.stdin.read(), sys.argv[1], sys.argv[2].split()
try:
    r = json.loads(text[text.index("{"):])["results"][0]
except (ValueError, KeyError, IndexError):
    r = {"status": "failed", "errors": [" ".join(text.split())[:300]]}
errors = [e.split(": ", 1)[1] if e.startswith("Turn ") else e for e in r.get("errors") or []]
verdict = r["status"]
if verdict != "passed":
    if test_id in expected:
        verdict = "expected"
    else:  # a turn that filled the context leaves no room for its continuation: the suite gets an error event
        responses = r.get("response") if isinstance(r.get("response"), list) else [r.get("response")]
        ran_out = any(isinstance(x, dict) and x.get("status") == "incomplete" for x in responses)
        if (ran_out or any(e in MODEL for e in errors)) and all(e in MODEL or e.endswith(AFTER) for e in errors):
            verdict = "model"
duration = r.get("duration") or 0
print(f"{verdict:<8} {test_id:<44} {duration:>6} ms", " | ".join(r.get("errors") or [])[:300])
'
key=sk-compliance-$$
failed=0
run_mode() {  # $1: the mode's name; the rest: its serve flags
  local mode=$1; shift
  local log; log=$(mktemp)
  python3 -m tandem serve --host 127.0.0.1 --port 0 --api-key "$key" --responses-events open-responses \
    "$@" "${serve_args[@]}" >"$log" 2>&1 &
  local pid=$! url="" t0=$SECONDS
  trap "kill $pid 2>/dev/null || true" EXIT
  for _ in $(seq 600); do
    url=$(sed -n 's/^tandem: serving .* at \(http[^ ]*\) .*/\1/p' "$log")
    [ -n "$url" ] && curl -fs "${url%/v1}/health" >/dev/null 2>&1 && break
    kill -0 $pid 2>/dev/null || { cat "$log"; echo "responses_compliance: the server did not start" >&2; exit 1; }
    sleep 0.2
  done
  local model; model=$(curl -fs -H "Authorization: Bearer $key" "$url/models" \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
  local passed=0 total=0 limited=0 expected=0 broken=0
  for id in $ids; do
    local out; out=$(cd "$suite" && "$bun" run bin/compliance-test.ts -u "$url" -k "$key" -m "$model" -f "$id" \
      --json 2>&1 || true)
    local line; line=$(printf '%s' "$out" | python3 -c "$classify" "$id" "$expected_fail")
    local verdict=${line%% *}
    total=$((total + 1))
    case $verdict in
      passed) passed=$((passed + 1)) ;;
      model) limited=$((limited + 1)) ;;
      expected) expected=$((expected + 1)) ;;
      *) failed=1; broken=$((broken + 1)) ;;
    esac
    printf '%-13s %s\n' "$mode" "$line"
  done
  kill $pid 2>/dev/null; wait $pid 2>/dev/null || true
  echo "responses_compliance: $mode: $passed of $total passed, $limited limited by the model, $expected expected" \
    "to fail, $broken failed in $((SECONDS - t0)) s"
  rm -f "$log"
}
serve_args=("$@")
[ -n "${TANDEM_COMPLIANCE_SEED-}" ] && serve_args+=(--seed "$TANDEM_COMPLIANCE_SEED")
run_mode thinking-on --reasoning-budget "$think"
run_mode thinking-off --default-chat-template-kwargs '{"enable_thinking": false}'
exit $failed
