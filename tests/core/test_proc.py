import os
import time
from pathlib import Path

from harbor_hpc.core.proc import run


def test_a_timeout_stops_the_tool_and_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    ran = run(["sh", "-c", f"sleep 30 & echo $! > {pid_file}; wait"], timeout=0.5)
    assert not ran.ok and "did not answer within 0.5 s" in ran.why()
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the tool's child {child} outlived the timeout")


def test_output_input_and_a_failure_line() -> None:
    echoed = run(["cat"], input="hello\n")
    assert echoed.ok and echoed.stdout == "hello\n"
    failed = run(["sh", "-c", "echo first >&2; echo 'the reason' >&2; exit 3"])
    assert not failed.ok and failed.returncode == 3 and failed.why() == "the reason"
    missing = run(["/nonexistent/tool"])
    assert not missing.ok and "cannot run /nonexistent/tool" in missing.why()
