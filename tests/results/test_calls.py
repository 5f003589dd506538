"""Which model calls a worker records: litellm's, whenever the agent imports it."""

from __future__ import annotations

import os
import subprocess
import sys

# In a fresh interpreter, as a worker is: recording begins before anything imported litellm
# (an oracle's worker never does: importing it costs some 3 CPU seconds), then an agent
# imports it at its first call, and the calls it makes are those recorded.
LAZY_AGENT = """
import asyncio, json, sys, tempfile
from pathlib import Path
from harbor_hpc.results.calls import CALLS_FILE, recording_calls

trial = Path(tempfile.mkdtemp())
with recording_calls(trial):
    assert "litellm" not in sys.modules
    import litellm

    try:
        asyncio.run(litellm.acompletion(
            model="openai/m", messages=[{"role": "user", "content": "hi"}],
            api_base="http://127.0.0.1:9/v1", api_key="k", num_retries=0, timeout=5,
        ))
    except Exception:
        pass
print(json.dumps([call["end"] for call in json.loads((trial / CALLS_FILE).read_text())["calls"]]))
"""


def test_calls_of_an_agent_that_imports_litellm_late_are_recorded() -> None:
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    ran = subprocess.run(
        [sys.executable, "-c", LAZY_AGENT], capture_output=True, text=True, env=env, timeout=120
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip().splitlines()[-1] == '["failed"]'
