"""Graceful drain on SIGTERM, for servers that stop on it (uvicorn, LiteLLM's proxy).

uvicorn stops listening on SIGTERM and waits for open requests; a parked request would wait for
its turn (or `queue.max_wait_s`) and then be cancelled with a bare 500. Chained in front of the
server's own handler, `install_sigterm_drain` first makes the service drain
(`SchedulingService.begin_drain`: parked requests get 503 `shutting_down` with `Retry-After`,
running ones get `drain_grace_s` to finish), then lets the server stop as it would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType

from .service import SchedulingService

logger = logging.getLogger("fair_sched")


def install_sigterm_drain(service: SchedulingService) -> Callable[[], None]:
    """Drain `service` on SIGTERM, then call the handler installed before (the server's).

    Call from the running loop, in the main thread (elsewhere nothing is installed: signals go
    to the main thread only). Returns the function that puts the previous handler back.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        # A signal handler runs between bytecodes of the loop's thread: schedule, do not act.
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to drain
            loop.call_soon_threadsafe(service.begin_drain)
            if previous == signal.SIG_DFL:
                # No server handler to defer to: terminate as the default would, once the
                # grace period is over.
                loop.call_soon_threadsafe(
                    loop.call_later, service.settings.drain_grace_s, _terminate, signum
                )
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)

    def uninstall() -> None:
        # Only if nobody chained in front of us since (they restore us when they leave).
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, previous)

    return uninstall


def _terminate(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)
