#!/usr/bin/env bash
# The README's test command: install test dependencies, type-check, run the tests interpreted, then build the
# mypyc-compiled modules in a scratch copy and run the tests against that build (on up to 4 cores through
# pytest-xdist: nothing else runs then). -rs: pytest names each skipped test and its reason (the `cuda` tests skip
# without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[test]'
# The real agents (tests/test_real_agents.py: Claude Code, Codex CLI and opencode from npm against a live server) run beside
# the interpreted pass, in the background (about 8 minutes of a small CPU, mostly Claude Code's 24k-token prompt
# prefilled); TANDEM_AGENTS=0 leaves them out, and without npm they skip.
agents=${TANDEM_AGENTS:-1}
if [ "$agents" = 1 ] && command -v npm >/dev/null \
    && ! { command -v claude >/dev/null && command -v codex >/dev/null && command -v opencode >/dev/null; }; then
  npm install -g -s @anthropic-ai/claude-code @openai/codex opencode-ai || echo "tools/test.sh: the agents did not install"
fi
# The Open Responses compliance suite (tests/test_responses_compliance.py, tools/responses_compliance.sh: bun from
# npm, the suite from GitHub or OPENRESPONSES_DIR) runs after the agents in their background session, about two
# minutes; TANDEM_COMPLIANCE=0 leaves it out, and where bun or the suite cannot be had it skips.
# The dashboard's browser test (tests/test_dashboard_browser.py) drives Debian's Chromium headless through its driver.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
    || echo "tools/test.sh: chromium did not install; the browser test skips"
fi
python3 -m mypy
agents_log=$(mktemp)
agents_pid=""
scratch=""
stop_agents() {  # the agents' session, whatever they left running in it (their own servers, helpers)
  if [ -n "$agents_pid" ]; then kill -- -"$agents_pid" 2>/dev/null || true; fi
}
cleanup() {  # an interrupted or failed run leaves no agent run or scratch copy behind
  stop_agents
  rm -rf "$agents_log" ${scratch:+"$scratch"}
}
trap cleanup EXIT
compliance=${TANDEM_COMPLIANCE:-1}
background=()
[ "$agents" = 1 ] && background+=(tests/test_real_agents.py)
[ "$compliance" = 1 ] && background+=(tests/test_responses_compliance.py)
if [ ${#background[@]} -gt 0 ]; then
  # in a session of their own: a process an agent leaves behind that signals its process group reaches only theirs
  TANDEM_AGENTS=$agents TANDEM_COMPLIANCE=$compliance setsid python3 -m pytest -q -rs -rP -p no:cacheprovider \
    "${background[@]}" >"$agents_log" 2>&1 &
  agents_pid=$!
fi
TANDEM_AGENTS=0 TANDEM_COMPLIANCE=0 python3 -m pytest -q -rs -p no:cacheprovider "$@"
if [ -n "$agents_pid" ]; then
  agents_rc=0
  wait "$agents_pid" || agents_rc=$?
  echo "tools/test.sh: the real agents and the compliance suite (tests/test_real_agents.py, test_responses_compliance.py):"
  tail -n 90 "$agents_log"
  stop_agents
  agents_pid=""
  [ "$agents_rc" = 0 ] || exit "$agents_rc"
fi
scratch=$(mktemp -d)
git ls-files -z | xargs -0 -I{} cp --parents {} "$scratch"
(cd "$scratch" && TANDEM_MYPYC=1 python3 setup.py -q build_ext --inplace >/dev/null \
  && python3 -c "import tandem.models.state as m, sys; sys.exit(0 if m.__file__.endswith('.so') else 'mypyc build missing')" \
  && python3 -m pytest -q -rs -p no:cacheprovider -m "not slow" -n auto --maxprocesses 4 "$@")
