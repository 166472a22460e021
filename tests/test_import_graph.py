"""The package's import graph (tools/import_graph.py, every import of a tandem module anywhere in a tandem module,
lazy and TYPE_CHECKING ones included) has no cycle, and the kernel layer knows no model: nothing under
tandem/backend imports tandem.models, tandem.speculative, tandem.server or tandem.engine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tools.import_graph import cycles, graph

REPO = Path(__file__).resolve().parents[1]
UPPER = ("tandem.models", "tandem.speculative", "tandem.server", "tandem.engine")


def test_the_tool_reports_no_cycle() -> None:
    run = subprocess.run([sys.executable, str(REPO / "tools" / "import_graph.py")], capture_output=True, text=True,
                         cwd=REPO, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("no cycles")


def test_the_graph_sees_lazy_imports() -> None:
    edges = graph(REPO)
    assert len(edges) > 50
    # tandem.models.qwen3_5.model imports cuda_model inside on_device only
    assert "tandem.models.qwen3_5.cuda_model" in edges["tandem.models.qwen3_5.model"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}}) == [["a"]] and cycles({"a": {"b"}, "b": set()}) == []


def test_backend_imports_no_upper_layer() -> None:
    bad = [(m, t) for m, targets in graph(REPO).items() if m.startswith("tandem.backend")
           for t in targets if any(t == u or t.startswith(u + ".") for u in UPPER)]
    assert not bad, f"the backend imports upper layers: {bad}"
