"""A supervised child does not outlive its parent, even when the parent is killed with SIGKILL."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.unit.polling import until

PARENT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from epp.dev.stack.supervisor import Child

    child = Child("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], Path(sys.argv[1]))
    child.start()
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: its state in /proc is Z.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux setpriv (Linux)")
async def test_a_child_gets_sigterm_when_its_parent_is_killed(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "sleeper.log")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert _alive(child_pid)
        time.sleep(0.2)  # setpriv has exec'd the child by now
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        await until(lambda: not _alive(child_pid), timeout=10.0)
        assert not _alive(child_pid)
    finally:
        parent.kill()
        parent.wait(10)
