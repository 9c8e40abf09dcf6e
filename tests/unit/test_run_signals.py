"""epp run's Ctrl-C handling: a second signal that arrives while the first one is being handled
(Ctrl-C twice; `timeout` or a process manager signalling both the process and its group) must not
stop the stack from stopping."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# CPython runs a Python signal handler at the next bytecode boundary, also inside another handler.
# The child below makes that happen at every Python call inside the handler (each time one more
# SIGINT arriving there), then checks that the supervision loop still sees the stop.
_CHILD = textwrap.dedent(
    """
    import signal, sys
    from epp.dev.stack.cli import _Stop

    stop = _Stop()
    stop.install()
    handler = signal.getsignal(signal.SIGINT)
    nested = False

    def tracer(frame, event, arg):
        global nested
        if event == "call" and not nested and frame.f_code is not handler.__code__:
            nested = True
            try:
                handler(signal.SIGTERM, None)  # the second signal, delivered here
            finally:
                nested = False
        return None

    def deliver():
        sys.settrace(tracer)
        try:
            handler(signal.SIGINT, None)
        finally:
            sys.settrace(None)

    signal.signal(signal.SIGINT, lambda *_: deliver())
    signal.raise_signal(signal.SIGINT)
    print("stopped" if stop.wait(1.0) else "not stopped", stop.signal)
    """
)


def test_a_second_signal_during_the_stop_handler_does_not_hang_the_stack() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=15, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "stopped"
