"""The real coding agents, non-interactively, with their defaults, against a live `tandem serve` on loopback:
`claude -p "say hi"` (Claude Code, npm @anthropic-ai/claude-code), `codex exec "say hi"` (Codex CLI, npm
@openai/codex) and `opencode run "say hi"` (opencode, npm opencode-ai, through an OpenAI-compatible provider in its
opencode.json), telemetry and update checks off; each must complete a run (exit status 0).

They run only with TANDEM_AGENTS=1; `bash tools/test.sh` (CI) sets it for one run of this file in the background,
beside the interpreted pass, after installing both from npm where they are missing (TANDEM_AGENTS=0 leaves them
out). Each skips when its agent is not on PATH. The server runs the embedded model with no arguments but the key, so
the test also shows that the default context takes each agent's real first prompt. Both are marked `slow` and
`agents`: on a 2-core CPU the first prompt (23,892 tokens for Claude Code) takes minutes to prefill.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from server_fixtures import EMBEDDED, ServerProcess

KEY = "sk-agents-ci"
RUN_TIMEOUT_S = 3600
pytestmark = [pytest.mark.slow, pytest.mark.agents,
              pytest.mark.skipif(os.environ.get("TANDEM_AGENTS", "0") != "1", reason="real agents only with TANDEM_AGENTS=1")]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    if not any(shutil.which(agent) for agent in ("claude", "codex", "opencode")):
        pytest.skip("no agent is installed (npm install -g @anthropic-ai/claude-code @openai/codex opencode-ai)")
    proc = ServerProcess(EMBEDDED, "--api-key", KEY)
    try:
        yield proc
    finally:
        proc.stop()


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env={**os.environ, **env}, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)


def test_claude_code_says_hi(server: ServerProcess, tmp_path: Path) -> None:
    if shutil.which("claude") is None:
        pytest.skip("claude is not installed (npm install -g @anthropic-ai/claude-code)")
    env = {"HOME": str(tmp_path), "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": KEY,
           "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    done = _run(["claude", "-p", "say hi"], env, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "API Error" not in done.stdout
    assert any(" messages 200 " in line for line in server.errors)


def test_codex_says_hi(server: ServerProcess, tmp_path: Path) -> None:
    if shutil.which("codex") is None:
        pytest.skip("codex is not installed (npm install -g @openai/codex)")
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "default"\nmodel_provider = "tandem"\ncheck_for_update_on_startup = false\n\n'
        '[analytics]\nenabled = false\n\n[model_providers.tandem]\nname = "Tandem"\n'
        f'base_url = "{server.url}/v1"\nenv_key = "TANDEM_API_KEY"\nwire_api = "responses"\n')
    env = {"HOME": str(tmp_path), "CODEX_HOME": str(home), "TANDEM_API_KEY": KEY}
    done = _run(["codex", "exec", "--skip-git-repo-check", "say hi"], env, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert any(" responses 200 " in line for line in server.errors)


def test_opencode_says_hi(server: ServerProcess, tmp_path: Path) -> None:
    if shutil.which("opencode") is None:
        pytest.skip("opencode is not installed (npm install -g opencode-ai)")
    project = tmp_path / "project"
    project.mkdir()
    config = {"$schema": "https://opencode.ai/config.json", "model": "tandem/default", "autoupdate": False,
              "share": "disabled",
              "provider": {"tandem": {"npm": "@ai-sdk/openai-compatible", "name": "Tandem",
                                      "options": {"baseURL": f"{server.url}/v1", "apiKey": KEY},
                                      "models": {"default": {"name": "default"}}}}}
    (project / "opencode.json").write_text(json.dumps(config))
    home = tmp_path / "home"
    home.mkdir()
    # opencode finds its project (and the project's opencode.json) from $PWD, not from the process's directory
    env = {"HOME": str(home), "PWD": str(project), "OPENCODE_DISABLE_AUTOUPDATE": "1"}
    done = _run(["opencode", "run", "say hi"], env, project)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert any(" chat 200 " in line for line in server.errors)
