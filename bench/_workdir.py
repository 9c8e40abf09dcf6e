"""A bench's run in its scratch work directory: kept, with its logs, when the run fails."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path


def run_in_workdir(
    workdir: Path,
    run: Callable[[], int],
    *,
    errors: tuple[type[Exception], ...],
    keep_logs: bool,
    report: Callable[[], object] = lambda: None,
) -> int:
    """``run()``'s exit status, then ``report()``; ``workdir`` is removed after a 0 unless ``keep_logs``.

    An exception of ``errors`` (status 1) or Ctrl-C (130) ends the run without a report and says
    where the logs are.
    """
    try:
        status = run()
    except errors as e:
        print(f"error: {e}\nlogs in {workdir}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted; logs in {workdir}", file=sys.stderr)
        return 130
    report()
    if keep_logs or status:
        print(f"logs in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return status
