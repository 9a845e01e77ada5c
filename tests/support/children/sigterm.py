"""A pytest plugin: a run stopped by SIGTERM ends as a Ctrl-C does.

A ``timeout`` around a test run sends SIGTERM, which by default ends pytest
at once, with no teardown. The servers that fixtures start run in sessions
of their own (so a test can kill their whole process group), out of the
signal's reach, and would stay on the GPU after the run. As a
``KeyboardInterrupt``, pytest still tears every fixture down at the end of
the session, and ``subprocess.run`` kills the child it was waiting for.
"""

from __future__ import annotations

import signal
import threading


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def pytest_configure(config: object) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
