"""The service's side of waiting clients: parked requests' positions, the measured drain rate,
`Retry-After` from it, and the client's own wait limit (a fake clock; no sleeps)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fair_sched_plugin.errors import QueueFull, QueueTimeout, SchedulerClosed
from fair_sched_plugin.request.identity import Credentials
from fair_sched_plugin.runtime.parked import ParkedRequest
from fair_sched_plugin.runtime.service import UNKNOWN_MODELS, Admission, SchedulingService
from fair_sched_plugin.testing import FakeClock, settle

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}


def make_service(clock: FakeClock, **settings: Any) -> SchedulingService:
    config = {
        # "m" has no backend: one in-flight slot (the unknown-models cap) decides.
        "unknown_model_max_inflight": 1,
        "principals": [{"name": "alice", "keys": ["sk-a"]}, {"name": "bob", "keys": ["sk-b"]}],
        **settings,
    }
    return SchedulingService(config, clock=clock)


class Recorder:
    """A `WaitObserver`: what the request's watch is told."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.parked_request: ParkedRequest | None = None

    def parked(self, parked: ParkedRequest) -> None:
        self.events.append("parked")
        self.parked_request = parked

    def unparked(self) -> None:
        self.events.append("unparked")

    def shutdown(self) -> None:
        self.events.append("shutdown")


async def test_thirty_parked_requests_of_one_principal_have_positions_in_order() -> None:
    clock = FakeClock()
    svc = make_service(clock)
    alice = svc.identify(Credentials(api_key="sk-a"))
    bob = svc.identify(Credentials(api_key="sk-b"))
    holder = await svc.admit(alice, "m", BODY)
    parked = [asyncio.ensure_future(svc.admit(alice, "m", BODY)) for _ in range(30)]
    await settle()
    mine = svc.standings.parked_of("alice")
    assert list(mine) == [UNKNOWN_MODELS] and len(mine[UNKNOWN_MODELS]) == 30
    positions = svc.standings.positions_of("alice", UNKNOWN_MODELS)
    assert list(positions.values()) == list(range(1, 31))
    assert svc.standings.parked_of("bob") == {}
    # Bob queues two: round robin puts his first after alice's first, so alice's later
    # requests move back by up to two places.
    bobs = [asyncio.ensure_future(svc.admit(bob, "m", BODY)) for _ in range(2)]
    await settle()
    positions = svc.standings.positions_of("alice", UNKNOWN_MODELS)
    assert list(positions.values())[:3] == [2, 4, 5]
    assert list(svc.standings.positions_of("bob", UNKNOWN_MODELS).values()) == [2, 4]
    holder.lease.release()
    for task in [*parked, *bobs]:
        task.cancel()
    await asyncio.gather(*parked, *bobs, return_exceptions=True)
    await svc.aclose()


async def test_the_wait_observer_hears_parked_and_unparked_once_each() -> None:
    clock = FakeClock()
    svc = make_service(clock)
    alice = svc.identify(Credentials(api_key="sk-a"))
    now_recorder = Recorder()
    holder = await svc.admit(alice, "m", BODY, waiting=now_recorder)
    assert now_recorder.events == []  # released at once: never parked
    recorder = Recorder()
    waiting = asyncio.ensure_future(svc.admit(alice, "m", BODY, waiting=recorder))
    await settle()
    assert recorder.events == ["parked"]
    assert recorder.parked_request is not None
    clock.advance(4.0)
    assert recorder.parked_request.wait_s() == 4.0
    assert recorder.parked_request.position() == 1
    holder.lease.release()
    admission: Admission = await asyncio.wait_for(waiting, 5)
    assert recorder.events == ["parked", "unparked"]
    assert svc.standings.parked_of("alice") == {}
    admission.lease.release()
    await svc.aclose()


async def test_retry_after_comes_from_the_measured_drain_rate() -> None:
    """A caller whose cap is full is told to come back when its oldest request would be
    released at the measured rate (positions ahead / releases per second), not a constant."""
    clock = FakeClock()
    svc = make_service(clock, queue={"max_per_user": 2, "max_wait_s": 600})
    alice = svc.identify(Credentials(api_key="sk-a"))
    bob = svc.identify(Credentials(api_key="sk-b"))
    for _ in range(5):  # one release every 2 s
        admission = await svc.admit(alice, "m", BODY)
        clock.advance(2.0)
        admission.lease.release()
    # Drain rate: 4 intervals over the 10 s since the first release.
    assert svc.drain.rate(UNKNOWN_MODELS, clock.now()) == pytest.approx(0.4)
    holder = await svc.admit(bob, "m", BODY)
    parked = [asyncio.ensure_future(svc.admit(alice, "m", BODY)) for _ in range(2)]
    parked.append(asyncio.ensure_future(svc.admit(bob, "m", BODY)))
    await settle()
    with pytest.raises(QueueFull) as full:
        await svc.admit(alice, "m", BODY)
    # Bob's admission was a sixth release (5 intervals over 10 s: 0.5/s). Alice's oldest is
    # released after at most bob's parked one: 2 positions at 0.5/s.
    assert svc.drain.rate(UNKNOWN_MODELS, clock.now()) == pytest.approx(0.5)
    assert full.value.retry_after_s == pytest.approx(2 / 0.5)
    assert full.value.retry_after_header == "4"
    holder.lease.release()
    for task in parked:
        task.cancel()
    await asyncio.gather(*parked, return_exceptions=True)
    await svc.aclose()


async def test_without_a_measured_rate_the_schedulers_hint_stays() -> None:
    clock = FakeClock()
    svc = make_service(clock, queue={"max_per_user": 1})
    alice = svc.identify(Credentials(api_key="sk-a"))
    holder = await svc.admit(alice, "m", BODY)
    parked = asyncio.ensure_future(svc.admit(alice, "m", BODY))
    await settle()
    with pytest.raises(QueueFull) as full:
        await svc.admit(alice, "m", BODY)
    assert full.value.retry_after_s >= 1.0
    holder.lease.release()
    (await asyncio.wait_for(parked, 5)).lease.release()
    await svc.aclose()


async def test_the_clients_wait_limit_gives_up_first_and_the_request_leaves_the_queue() -> None:
    clock = FakeClock()
    svc = make_service(clock, queue={"max_wait_s": 600})
    alice = svc.identify(Credentials(api_key="sk-a"))
    holder = await svc.admit(alice, "m", BODY)
    waiting = asyncio.ensure_future(svc.admit(alice, "m", BODY, max_wait_s=10))
    await settle()
    clock.advance(9.9)
    await settle()
    assert not waiting.done()
    clock.advance(0.1)
    with pytest.raises(QueueTimeout, match="its client's limit of 10 s") as timed_out:
        await waiting
    assert timed_out.value.status_code == 504
    await settle()
    stats = svc.scheduler.statistics()
    assert stats.queued == 0 and stats.timed_out_total == 1 and stats.cancelled_total == 0
    holder.lease.release()
    await svc.aclose()


async def test_a_grant_at_the_clients_deadline_is_served_not_thrown_away() -> None:
    """Race: the lease is granted and the client's wait limit passes in the same loop turn.
    The grant wins: the request gets its lease (nothing is released to nobody)."""
    clock = FakeClock()
    svc = make_service(clock)
    alice = svc.identify(Credentials(api_key="sk-a"))
    holder = await svc.admit(alice, "m", BODY)
    waiting = asyncio.ensure_future(svc.admit(alice, "m", BODY, max_wait_s=10))
    await settle()
    holder.lease.release()  # grants the parked request ...
    clock.advance(10.0)  # ... and its deadline passes before it runs again
    admission = await asyncio.wait_for(waiting, 5)
    assert admission.lease.active
    admission.lease.release()
    stats = svc.scheduler.statistics()
    assert stats.in_flight == 0 and stats.abandoned_total == 0
    await svc.aclose()


async def test_shutdown_refuses_parked_requests_as_shutting_down_with_retry_after() -> None:
    svc = make_service(FakeClock())
    alice = svc.identify(Credentials(api_key="sk-a"))
    holder = await svc.admit(alice, "m", BODY)
    parked = asyncio.ensure_future(svc.admit(alice, "m", BODY))
    await settle()
    await svc.aclose()
    with pytest.raises(SchedulerClosed) as closed:
        await parked
    assert closed.value.status_code == 503
    assert closed.value.error_code == "shutting_down"
    assert int(closed.value.retry_after_header) >= 1
    holder.lease.release()


class Holder(Recorder):
    @property
    def ended(self) -> bool:
        return "shutdown" in self.events


async def test_drain_refuses_parked_at_once_and_ends_running_ones_after_the_grace() -> None:
    """`begin_drain`: the parked request gets `SchedulerClosed` (503 shutting_down) at once,
    new ones too; a running one is ended only when `drain_grace_s` has passed on the clock."""
    clock = FakeClock()
    svc = make_service(clock, drain_grace_s=20)
    alice = svc.identify(Credentials(api_key="sk-a"))
    running = Holder()
    admission = await svc.admit(alice, "m", BODY, waiting=running)
    parked = asyncio.ensure_future(svc.admit(alice, "m", BODY, waiting=Holder()))
    await settle()
    svc.begin_drain()
    assert svc.draining
    with pytest.raises(SchedulerClosed):
        await parked
    with pytest.raises(SchedulerClosed):
        await svc.admit(alice, "m", BODY)
    clock.advance(19.0)
    assert not running.ended  # still within the grace period
    clock.advance(1.0)
    assert running.ended
    admission.lease.release()
    await svc.aclose()


async def test_a_request_that_ends_within_the_grace_is_not_ended_again() -> None:
    clock = FakeClock()
    svc = make_service(clock, drain_grace_s=5)
    alice = svc.identify(Credentials(api_key="sk-a"))
    running = Holder()
    admission = await svc.admit(alice, "m", BODY, waiting=running)
    svc.begin_drain()
    admission.lease.release()
    clock.advance(5.0)
    assert not running.ended
    await svc.aclose()


class _CountingBacklog:
    """Wraps the scheduler's `backlog()` (an O(backlogged users) scan) to count its calls."""

    def __init__(self, svc: SchedulingService) -> None:
        self.calls = 0
        self._backlog = svc.scheduler.backlog

        def counted(model: str | None = None) -> Any:
            self.calls += 1
            return self._backlog(model)

        svc.scheduler.backlog = counted  # type: ignore[method-assign]


async def test_estimates_read_counts_and_never_scan_the_backlog() -> None:
    """Positions, ETAs, `Retry-After` and the where-do-I-stand document per request cost
    O(log n): none of them lists the backlog (which costs O(everything queued))."""
    clock = FakeClock()
    svc = make_service(clock, queue={"max_per_user": 30, "max_wait_s": 600})
    alice = svc.identify(Credentials(api_key="sk-a"))
    bob = svc.identify(Credentials(api_key="sk-b"))
    for _ in range(3):  # a measured drain rate, so ETAs and Retry-After are computed
        clock.advance(1.0)
        (await svc.admit(bob, "m", BODY)).lease.release()
    holder = await svc.admit(bob, "m", BODY)
    recorders = [Recorder() for _ in range(30)]
    parked = [asyncio.ensure_future(svc.admit(alice, "m", BODY, waiting=r)) for r in recorders]
    parked += [asyncio.ensure_future(svc.admit(bob, "m", BODY)) for _ in range(2)]
    await settle()
    scans = _CountingBacklog(svc)
    standings = [r.parked_request.standing() for r in recorders if r.parked_request]
    assert [position for position, _, _ in standings][:3] == [2, 4, 5]
    assert all(eta is not None for _, eta, _ in standings)
    document = svc.standings.standing_of(alice)
    assert [row["position"] for row in document["models"][UNKNOWN_MODELS]["parked"]][:3] == [
        2,
        4,
        5,
    ]
    assert svc.standings.suggest_retry_after(UNKNOWN_MODELS, user="carol") is not None
    with pytest.raises(QueueFull) as full:
        await svc.admit(alice, "m", BODY)
    assert full.value.retry_after_s >= 1.0
    assert scans.calls == 0
    holder.lease.release()
    for task in parked:
        task.cancel()
    await asyncio.gather(*parked, return_exceptions=True)
    await svc.aclose()


async def test_keepalive_comments_never_scan_the_backlog() -> None:
    """A parked stream's comments (real loop, real `RequestWatch`) read the counts only."""
    from fair_sched_plugin.request.watch import RequestWatch

    svc = make_service(
        FakeClock(), queue={"keepalive_after_s": 0.001, "keepalive_interval_s": 0.001}
    )
    alice = svc.identify(Credentials(api_key="sk-a"))
    holder = await svc.admit(alice, "m", BODY)
    scans = _CountingBacklog(svc)
    comments: list[bytes] = []
    three_comments = asyncio.Event()

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body":
            comments.append(message["body"])
            if len(comments) >= 3:
                three_comments.set()

    watch = RequestWatch(None, send)
    watch.streaming = True
    waiting = asyncio.ensure_future(svc.admit(alice, "m", {**BODY, "stream": True}, waiting=watch))
    await asyncio.wait_for(three_comments.wait(), 10)
    assert all(comment.startswith(b": queued position=1 ") for comment in comments)
    assert scans.calls == 0
    holder.lease.release()
    (await asyncio.wait_for(waiting, 5)).lease.release()
    await svc.aclose()


async def test_a_parked_requests_eta_never_grows_while_nothing_drains() -> None:
    """The keep-alive bug: position 1 stayed and its ETA grew every second (0.5, 1.0, ...)
    until the request timed out. Now it counts down from the last release and, once the
    request should have gone at the measured rate, there is no ETA at all."""
    clock = FakeClock()
    svc = make_service(clock)
    alice = svc.identify(Credentials(api_key="sk-a"))
    for _ in range(3):  # two releases a second
        (await svc.admit(alice, "m", BODY)).lease.release()
        clock.advance(0.5)
    holder = await svc.admit(alice, "m", BODY)
    recorder = Recorder()
    waiting = asyncio.ensure_future(svc.admit(alice, "m", BODY, waiting=recorder))
    await settle()
    assert recorder.parked_request is not None
    etas = []
    for _ in range(6):
        assert recorder.parked_request.position() == 1
        etas.append(recorder.parked_request.eta_s())
        clock.advance(0.25)
    known = [eta for eta in etas if eta is not None]
    assert known == sorted(known, reverse=True) and known[0] == pytest.approx(0.5)
    assert etas[-1] is None
    assert svc.standings.standing_of(alice)["models"][UNKNOWN_MODELS]["parked"][0]["eta_s"] is None
    holder.lease.release()
    (await asyncio.wait_for(waiting, 5)).lease.release()
    await svc.aclose()
