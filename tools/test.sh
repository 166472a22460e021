#!/usr/bin/env bash
# The README's test command: install test dependencies, type-check, run the tests interpreted, then build the
# mypyc-compiled modules in a scratch copy and run the tests against that build. -rs: pytest names each skipped
# test and its reason (the `cuda` tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[test]'
# The real agents (tests/test_real_agents.py) only on request: their runs take minutes on a small CPU.
if [ "${TANDEM_AGENTS:-0}" = 1 ] && command -v npm >/dev/null; then
  npm install -g -s @anthropic-ai/claude-code @openai/codex || echo "tools/test.sh: the agents did not install"
fi
# The Open Responses compliance suite (tests/test_responses_compliance.py, tools/responses_compliance.sh) only on
# request too: TANDEM_COMPLIANCE=1 (bun from npm; two to six minutes with the embedded model on a small CPU).
# The dashboard's browser test (tests/test_dashboard_browser.py) drives Debian's Chromium headless through its driver.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
    || echo "tools/test.sh: chromium did not install; the browser test skips"
fi
python3 -m mypy
python3 -m pytest -q -rs -p no:cacheprovider "$@"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
git ls-files -z | xargs -0 -I{} cp --parents {} "$scratch"
(cd "$scratch" && TANDEM_MYPYC=1 python3 setup.py -q build_ext --inplace >/dev/null \
  && python3 -c "import tandem.models.state as m, sys; sys.exit(0 if m.__file__.endswith('.so') else 'mypyc build missing')" \
  && python3 -m pytest -q -rs -p no:cacheprovider -m "not slow" "$@")
