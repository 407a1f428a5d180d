"""Scrape one deployment's `/metrics` in the background and hand each result to a callback.

Every cycle produces exactly one `BackendSnapshot`: ok with the parsed signals, or failed with a
short reason. Failures are translated here, at the boundary; no httpx exception leaves this module.
A plain `http://` engine is read over one kept connection without httpx (`_plain_http`), unless
the watcher was given a client or the environment names a proxy for it.

Where the engine serves its page filtered by series name (vLLM: `/metrics/?name[]=...`, see
`filtered_metrics_url`), only the series the parser reads are asked for. An engine that answers
that request with anything but a page it can read (a 404, a redirect, no queue counts; not a
server error, which fails the scrape as on the whole page) is asked for the whole page at once,
in the same scrape, and from then on: one line at INFO says so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import TracebackType

import httpx

from ..config import safe_url
from ..core.snapshot import BackendSnapshot
from ..runtime.engine_http import KEEPALIVE_EXPIRY_S
from ._plain_http import BodyTooLarge, PlainHttpConnection, PlainHttpError, plain_http_reachable
from .parser import (
    MetricsParseError,
    ParsedMetrics,
    parse_metrics,
    recent_mean,
    recent_prefix_cache_hit_rate,
    recent_tpot,
)
from .profiles import MetricProfile, filtered_metrics_url

__all__ = ["DEFAULT_MAX_BODY_BYTES", "MetricsWatcher"]

logger = logging.getLogger(__name__)

# A vLLM /metrics page is ~50 kB; anything this large is not an engine's metrics page.
DEFAULT_MAX_BODY_BYTES = 5 * 1024 * 1024

_SCRAPING = "scraping"
# The scrape deadline is this many times a good scrape's usual duration (an exponential
# average, the newest good scrape weighing _USUAL_WEIGHT), never below the configured timeout.
_DEADLINE_PER_USUAL = 3.0
_USUAL_WEIGHT = 0.3
_DELIVERING = "delivering a snapshot"


class _ScrapeFailed(Exception):
    """Internal: one scrape failed for an expected reason (network, status, size, encoding)."""


class _TimedOut(_ScrapeFailed):
    """Internal: one scrape took longer than its deadline."""


class _BadAnswer(_ScrapeFailed):
    """Internal: the server answered, with something that is not a page we read (status, size,
    encoding); not a network failure."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.status = status


class MetricsWatcher:
    """One background task that scrapes `url` every `interval_s` and reports to `on_snapshot`.

    `clock` is the time base of `BackendSnapshot.started_at` and must be the gate's clock; it
    defaults to the running loop's time. Scheduling itself always uses the loop's time.
    `request_early_scrape()` starts the next scrape now, but never sooner than `min_gap_s`
    (default `interval_s / 4`) after the previous one started. Call it from the loop's thread.
    `active()`, where given, is asked before each scrape: while it says False the engine is not
    read at all.
    """

    def __init__(
        self,
        url: str,
        profile: MetricProfile,
        *,
        model_name: str | None,
        interval_s: float,
        timeout_s: float,
        on_snapshot: Callable[[BackendSnapshot], None],
        client: httpx.AsyncClient | None = None,
        clock: Callable[[], float] | None = None,
        min_gap_s: float | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        longest_timeout_s: float | None = None,
        name_filter: bool = True,
        active: Callable[[], bool] | None = None,
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("interval_s and timeout_s must be greater than 0")
        if min_gap_s is not None and min_gap_s < 0:
            raise ValueError("min_gap_s must not be negative")
        self.url = url
        # What logs call it: the URL may carry credentials (derived from such an api_base).
        self._shown = safe_url(url)
        self._profile = profile
        # The page with only our series where the engine serves one (`name_filter` off: never).
        # Both parsed once: httpx checks a URL given as text character by character on every
        # request, and the filtered one is ~800 characters (a tenth of a scrape's CPU).
        filtered = filtered_metrics_url(url, profile) if name_filter else None
        self._filtered_url = httpx.URL(filtered) if filtered is not None else None
        self._url = httpx.URL(url)
        self._model_name = model_name
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        # A loaded engine renders /metrics slowly (vLLM's API server on a starved CPU took a
        # second and more), and a scrape cut off at `timeout_s` each time never
        # completes: the gate then falls back although the engine answers. So the deadline
        # follows what good scrapes take (3x their smoothed duration, never below `timeout_s`),
        # doubles after a timeout, and stops at `longest_timeout_s` (4x `timeout_s` unless
        # given), which bounds how long a hung engine keeps a scrape waiting.
        self._longest_timeout_s = max(timeout_s, longest_timeout_s or 4 * timeout_s)
        self._deadline_s = timeout_s
        self._usual_s: float | None = None
        self._min_gap_s = interval_s / 4 if min_gap_s is None else min(min_gap_s, interval_s)
        self._max_body_bytes = max_body_bytes
        self._on_snapshot = on_snapshot
        # Asked before each scrape: False skips it (another replica decides and reads the
        # engine; see `SchedulingService`). `request_early_scrape()` ends the wait at once.
        self._active = active
        self._client = client
        self._owns_client = client is None
        # Scrapes of a plain http:// engine this watcher reads with its own client go over one
        # kept connection without httpx (`_plain_http`: a tenth of the CPU, ten times a second).
        self._plain = (
            PlainHttpConnection(self._url, keepalive_expiry_s=KEEPALIVE_EXPIRY_S)
            if client is None and plain_http_reachable(self._url)
            else None
        )
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False
        self._previous: ParsedMetrics | None = None
        self._last_snapshot: BackendSnapshot | None = None
        self._prefix_cache_hit_rate: float | None = None
        self._scrapes_total = 0
        self._failures_total = 0
        # A bug (not a network failure) is logged with its traceback once per streak, per place.
        self._bug_streaks: set[str] = set()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start scraping; needs a running event loop. A closed watcher cannot be restarted."""
        if self._closed:
            raise RuntimeError("MetricsWatcher is closed; create a new one")
        if self._task is not None:
            raise RuntimeError("MetricsWatcher is already started")
        loop = asyncio.get_running_loop()
        if self._client is None and self._plain is None:
            limits = httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)
            self._client = httpx.AsyncClient(limits=limits)
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run(), name=f"fair-sched metrics {self._shown}")

    async def aclose(self) -> None:
        """Stop the task and close the client if this watcher created it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        task, self._task = self._task, None
        try:
            if task is not None:
                await self._stop(task)
        finally:
            if self._plain is not None:
                self._plain.close()
            if self._owns_client and self._client is not None:
                await self._client.aclose()

    async def _stop(self, task: asyncio.Task[None]) -> None:
        # The wake-up is a second way out of the loop, should a cancellation be lost (a known
        # asyncio.wait_for race before Python 3.12).
        self.request_early_scrape()
        task.cancel()
        # asyncio.wait() neither raises the task's CancelledError nor swallows our own.
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            logger.error("metrics watcher for %s died", self._shown, exc_info=task.exception())

    async def __aenter__(self) -> MetricsWatcher:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- public state ----------------------------------------------------------------------------

    def request_early_scrape(self) -> None:
        """Scrape as soon as the minimum gap allows, e.g. right after releasing requests."""
        if self._wake is not None:
            self._wake.set()

    @property
    def last_snapshot(self) -> BackendSnapshot | None:
        return self._last_snapshot

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Prefix-cache hits per queried prompt token between the last two good scrapes (for
        the status page; the gate does not use it)."""
        return self._prefix_cache_hit_rate

    @property
    def scrapes_total(self) -> int:
        """Scrapes attempted and reported, failed ones included."""
        return self._scrapes_total

    @property
    def failures_total(self) -> int:
        return self._failures_total

    @property
    def filtering(self) -> bool:
        """Whether scrapes ask for the engine's page filtered to our series (see the module)."""
        return self._filtered_url is not None

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    # -- the loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None  # set by start() before the task exists
        while not self._closed:
            scrape_began = loop.time()
            # A request made while this scrape is in flight may postdate what it reads, so only
            # requests made before it are cleared.
            wake.clear()
            if self._active is not None and not self._active():
                await self._wait_for_next_scrape(loop, wake, scrape_began)
                continue
            snapshot = await self._scrape_once()
            self._publish(snapshot)
            await self._wait_for_next_scrape(loop, wake, scrape_began)

    async def _wait_for_next_scrape(
        self, loop: asyncio.AbstractEventLoop, wake: asyncio.Event, scrape_began: float
    ) -> None:
        due = scrape_began + self._interval_s
        if due <= loop.time():
            return
        # The next scrape is due, or asked for early: whichever sets `wake` first (a timer, not
        # `asyncio.wait_for`, which makes a task of every wait, ten a second per engine).
        timer = loop.call_at(due, wake.set)
        try:
            await wake.wait()
        finally:
            timer.cancel()
        until_gap_over = scrape_began + self._min_gap_s - loop.time()
        if until_gap_over > 0:
            await asyncio.sleep(until_gap_over)

    @property
    def deadline_s(self) -> float:
        """How long the next scrape may take (see `__init__`)."""
        return self._deadline_s

    def _took(self, seconds: float) -> None:
        usual = self._usual_s
        self._usual_s = seconds if usual is None else usual + _USUAL_WEIGHT * (seconds - usual)
        self._deadline_s = min(
            self._longest_timeout_s, max(self._timeout_s, _DEADLINE_PER_USUAL * self._usual_s)
        )

    async def _scrape_once(self) -> BackendSnapshot:
        started_at = self._now()  # before the GET: anything released earlier may be counted
        began = asyncio.get_running_loop().time()
        try:
            parsed = await self._read()
            self._took(asyncio.get_running_loop().time() - began)
        except _TimedOut as exc:
            self._deadline_s = min(self._longest_timeout_s, 2 * self._deadline_s)
            return self._failed(started_at, str(exc))
        except (_ScrapeFailed, MetricsParseError) as exc:
            return self._failed(started_at, str(exc))
        except Exception as exc:
            # Not a network or format problem: a bug. Report the scrape as failed so the gate
            # falls back safely, and keep the loop alive.
            self._log_bug_once(_SCRAPING, exc)
            return self._failed(started_at, f"internal error: {type(exc).__name__}")
        previous = self._previous
        tpot_s = recent_tpot(previous, parsed)
        ttft_s = queue_time_s = None
        if previous is not None:
            ttft_s = recent_mean(
                (previous.ttft_sum, previous.ttft_count), (parsed.ttft_sum, parsed.ttft_count)
            )
            queue_time_s = recent_mean(
                (previous.queue_time_sum, previous.queue_time_count),
                (parsed.queue_time_sum, parsed.queue_time_count),
            )
        self._prefix_cache_hit_rate = recent_prefix_cache_hit_rate(self._previous, parsed)
        self._previous = parsed
        self._bug_streaks.discard(_SCRAPING)
        return BackendSnapshot(
            url=self.url,
            started_at=started_at,
            ok=True,
            waiting=parsed.waiting,
            running=parsed.running,
            kv_usage=parsed.kv_usage,
            tpot_s=tpot_s,
            ttft_s=ttft_s,
            queue_time_s=queue_time_s,
            requests_finished=parsed.requests_finished,
        )

    async def _read(self) -> ParsedMetrics:
        """One page, parsed: the filtered one while the engine serves it, else the whole."""
        filtered = self._filtered_url
        if filtered is not None:
            try:
                return parse_metrics(await self._fetch(filtered), self._profile, self._model_name)
            except (_BadAnswer, MetricsParseError) as exc:
                # Timeouts, network errors and server errors (a restarting engine behind a
                # reverse proxy answers 502) say nothing about the filter: they propagate.
                if isinstance(exc, _BadAnswer) and (exc.status or 0) >= 500:
                    raise
                self._filtered_url = None
                logger.info(
                    "metrics of %s: the engine does not serve its page filtered by series name "
                    "(%s); reading the whole page from now on",
                    self._shown,
                    exc,
                )
        return parse_metrics(await self._fetch(self._url), self._profile, self._model_name)

    async def _fetch(self, url: httpx.URL) -> str:
        deadline = self._deadline_s
        try:
            # wait_for bounds the whole exchange (httpx's timeout only each phase of its own), so
            # a server that trickles bytes cannot stall the loop either.
            if self._plain is not None:
                fetching = self._fetch_plain(self._plain, url)
            else:
                assert self._client is not None  # set by start()
                fetching = self._fetch_text(self._client, url, deadline)
            return _text(await asyncio.wait_for(fetching, timeout=deadline))
        except (asyncio.TimeoutError, httpx.TimeoutException):
            raise _TimedOut(f"timed out after {deadline:g}s") from None
        except BodyTooLarge:
            raise _BadAnswer(f"body larger than {self._max_body_bytes} bytes") from None
        except PlainHttpError as exc:
            raise _ScrapeFailed(str(exc)) from None
        except httpx.HTTPError as exc:
            raise _ScrapeFailed(f"{type(exc).__name__}: {exc}") from None

    async def _fetch_plain(self, connection: PlainHttpConnection, url: httpx.URL) -> bytes:
        status, body = await connection.get(url, self._max_body_bytes)
        if status != 200:
            raise _BadAnswer(f"HTTP {status}", status)
        return body

    async def _fetch_text(
        self, client: httpx.AsyncClient, url: httpx.URL, deadline: float
    ) -> bytes:
        async with client.stream("GET", url, timeout=deadline) as response:
            if response.status_code != 200:
                raise _BadAnswer(f"HTTP {response.status_code}", response.status_code)
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self._max_body_bytes:
                raise _BadAnswer(f"body larger than {self._max_body_bytes} bytes")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > self._max_body_bytes:
                    raise _BadAnswer(f"body larger than {self._max_body_bytes} bytes")
        return bytes(body)

    def _failed(self, started_at: float, reason: str) -> BackendSnapshot:
        # DEBUG only: at 10 scrapes a second a dead engine would flood WARNING; the gate logs the
        # transition to and from "metrics unavailable" once.
        logger.debug("metrics scrape of %s failed: %s", self._shown, reason)
        return BackendSnapshot.failed(self.url, started_at, reason)

    def _publish(self, snapshot: BackendSnapshot) -> None:
        self._scrapes_total += 1
        if not snapshot.ok:
            self._failures_total += 1
        self._last_snapshot = snapshot
        try:
            self._on_snapshot(snapshot)
        except Exception as exc:
            self._log_bug_once(_DELIVERING, exc)
        else:
            self._bug_streaks.discard(_DELIVERING)

    def _log_bug_once(self, doing: str, exc: Exception) -> None:
        if doing in self._bug_streaks:
            logger.debug("metrics watcher for %s: error %s: %r", self._shown, doing, exc)
            return
        self._bug_streaks.add(doing)
        logger.error(
            "metrics watcher for %s: unexpected error %s", self._shown, doing, exc_info=exc
        )

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()


def _text(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise _BadAnswer("body is not UTF-8 text") from None
