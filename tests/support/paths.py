"""Where the tests find the repository, their data files and the oracle venv's scripts."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
ORACLE_TOOLS = REPO / "tools" / "oracle"  # scripts that run inside the oracle venv
KV_EVENT_FIXTURES = DATA / "vllm-0.33.0-kv-events.json"
