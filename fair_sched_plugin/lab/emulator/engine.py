"""A continuous-batching engine that behaves like vLLM's scheduler, without a model.

The engine keeps one waiting queue (FIFO, or ordered by the request's ``priority`` under the
``priority`` policy), runs at most ``max_num_seqs`` sequences, and produces one token per running
sequence per step. A step lasts longer with a bigger batch and with prompt tokens prefilled on it,
which is what makes a flood of requests slow everybody else down, exactly like the real engine.

Nothing here touches the event loop until the first request arrives: the loop task is created
lazily by :meth:`EmulatedEngine.submit` and owned by the engine until :meth:`EmulatedEngine.aclose`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

SchedulingPolicy = Literal["fcfs", "priority"]
MetricsProfile = Literal["vllm", "sglang", "tgi"]
MetricsMode = Literal["ok", "error", "garbage", "missing"]

METRICS_MODES: tuple[MetricsMode, ...] = ("ok", "error", "garbage", "missing")


@dataclass
class FaultSwitches:
    """Failure modes an integration test can switch on, also while the emulator runs.

    Mutable on purpose: tests flip them through ``engine.faults`` or ``POST /emulator/faults``.
    """

    metrics_delay_s: float = 0.0
    """``/metrics`` answers only after this many seconds."""
    metrics_mode: MetricsMode = "ok"
    """``error``: HTTP 500; ``garbage``: 200 with text that is not Prometheus; ``missing``: 404."""
    fail_every_nth_completion: int = 0
    """Every Nth completion request (counted over both endpoints) gets HTTP 500; 0 = never."""
    first_byte_delay_s: float = 0.0
    """Completion responses start (and the request reaches the engine) only after this delay."""
    slow: float = 1.0
    """Every engine step takes this many times longer (a change of speed: 3.0 is 3x slower);
    on top of the instance's own ``EmulatorConfig.speed``."""
    metrics_filter: bool = True
    """``GET /metrics/?name[]=...`` answers with only the named samples (as vLLM 0.32 does);
    False: it answers 404, as an engine or a reverse proxy that serves only ``/metrics``."""
    fail_prompt: str = ""
    """Completion requests whose prompt contains this text (when not empty) get HTTP 500, before
    they reach the engine: some requests fail while the others are served (a gateway in front
    may drop fields such as ``user``, never the prompt)."""
    drop_prompt: str = ""
    """Streams whose prompt contains this text (when not empty) break after their first tokens:
    the connection closes without the stream's end, as when an engine dies mid-answer."""

    def update(self, changes: dict[str, object]) -> None:
        """Apply a partial update, validating names and types (used by the admin endpoint)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = set(changes) - known
        if unknown:
            raise ValueError(f"unknown fault switch(es): {sorted(unknown)}")
        validated = dataclasses.replace(self, **changes)  # type: ignore[arg-type]
        validated.validate()
        for name in changes:
            setattr(self, name, getattr(validated, name))

    def validate(self) -> None:
        for name in ("metrics_delay_s", "first_byte_delay_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        slow = self.slow
        if isinstance(slow, bool) or not isinstance(slow, (int, float)) or not slow > 0:
            raise ValueError(f"slow must be a number > 0, got {slow!r}")
        if self.metrics_mode not in METRICS_MODES:
            raise ValueError(
                f"metrics_mode must be one of {METRICS_MODES}, got {self.metrics_mode!r}"
            )
        for name in ("fail_prompt", "drop_prompt"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.metrics_filter, bool):
            raise ValueError(f"metrics_filter must be true or false, got {self.metrics_filter!r}")
        nth = self.fail_every_nth_completion
        if isinstance(nth, bool) or not isinstance(nth, int) or nth < 0:
            raise ValueError(f"fail_every_nth_completion must be an int >= 0, got {nth!r}")


@dataclass(frozen=True)
class EmulatorConfig:
    """Settings of one emulated engine; validated in ``__post_init__``."""

    models: tuple[str, ...] = ("emulated-model",)
    max_num_seqs: int = 8
    policy: SchedulingPolicy = "fcfs"
    base_step_ms: float = 10.0
    """Duration of one decode step with an empty batch."""
    step_ms_per_running_seq: float = 0.5
    """Extra step time per running sequence (a bigger batch decodes more slowly)."""
    prefill_ms_per_token: float = 0.02
    """Extra step time per prompt token prefilled on that step (tokens found in the prefix cache
    are not prefilled)."""
    kv_capacity_tokens: int = 16384
    """Denominator of ``kv_cache_usage_perc`` (prompt + generated tokens of running sequences)."""
    metrics_profile: MetricsProfile = "vllm"
    success_counter: bool = True
    """With the vLLM profile, export ``vllm:request_success_total``. False: the gauges and
    histograms only, like an engine without a finished counter the gate can read (SGLang's and
    TGI's profiles have none), so the gate counts arrivals from its own ends instead."""
    default_max_tokens: int = 16
    max_new_tokens: int = 0
    """Caps every request's ``max_tokens``, as vLLM's ``--generation-config`` ``max_new_tokens``
    does: longer requests end early (``finish_reason: length``) and report what they generated;
    0 = no cap."""
    filler_word: str = " token"
    """Output token i reads this word and the digit i % 10 (never two equal chunks in a row)."""
    request_log_size: int = 10_000
    """How many received / finished requests the engine remembers for tests (bounded memory)."""
    speed: float = 1.0
    """How fast this instance is: every step (prefill included) takes ``1 / speed`` as long, so
    0.33 emulates a replica three times slower than its peers. The ``slow`` fault changes the
    speed while the emulator runs."""
    prefix_cache_blocks: int = 0
    """Size of the prefix cache in blocks of ``block_tokens`` prompt tokens; 0 = no caching."""
    block_tokens: int = 16
    """Prompt tokens per cache block (vLLM's default block size)."""
    faults: FaultSwitches = field(default_factory=FaultSwitches)
    """Initial fault switches; the engine works on a copy, so this config stays unchanged."""

    def __post_init__(self) -> None:
        if not self.models or any(not name for name in self.models):
            raise ValueError(f"models must name at least one model, got {self.models!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.metrics_profile not in ("vllm", "sglang", "tgi"):
            raise ValueError(
                f"metrics_profile must be vllm|sglang|tgi, got {self.metrics_profile!r}"
            )
        for name in ("base_step_ms", "step_ms_per_running_seq", "prefill_ms_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.kv_capacity_tokens < 1 or self.default_max_tokens < 1:
            raise ValueError("kv_capacity_tokens and default_max_tokens must be >= 1")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if isinstance(self.speed, bool) or not self.speed > 0:
            raise ValueError(f"speed must be a number > 0, got {self.speed!r}")
        if self.prefix_cache_blocks < 0:
            raise ValueError(f"prefix_cache_blocks must be >= 0, got {self.prefix_cache_blocks}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        self.faults.validate()


class PrefixCache:
    """An LRU of prompt blocks, each keyed by its content chained to every block before it.

    Like vLLM's automatic prefix caching, a prompt hits on its longest run of leading blocks that
    are cached, and never on its last token (the engine must compute at least one token to
    produce the first output). Unlike vLLM, blocks of running requests are not pinned: the cache
    is bounded only by ``capacity`` blocks, which is all a scheduler in front of it can observe.
    """

    def __init__(self, capacity: int, block_tokens: int) -> None:
        self.capacity = capacity
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, blocks: tuple[int, ...], prompt_tokens: int) -> int:
        """Cached leading tokens of a prompt; the hit blocks become the most recently used."""
        usable = min(len(blocks), (prompt_tokens - 1) // self.block_tokens)
        hits = 0
        while hits < usable and blocks[hits] in self._blocks:
            self._blocks.move_to_end(blocks[hits])
            hits += 1
        return hits * self.block_tokens

    def insert(self, blocks: tuple[int, ...]) -> None:
        """Remember a prefilled prompt's blocks, evicting the least recently used beyond
        ``capacity``."""
        if self.capacity == 0:
            return
        for block in blocks:
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class SequenceState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class EngineClosedError(RuntimeError):
    """The engine was closed; no request can be submitted any more."""


@dataclass(frozen=True)
class ReceivedRequest:
    """What the engine remembers about each request, for tests to inspect."""

    request_id: str
    model: str
    priority: int
    prompt_tokens: int
    max_tokens: int
    user: str | None


class EngineStatistics(NamedTuple):
    waiting: int
    running: int
    max_waiting_seen: int
    """The longest queue left after a step's scheduling (what vLLM reports as waiting)."""
    max_running_seen: int
    requests_received: int
    requests_finished: int
    requests_aborted: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries_total: int
    """Prompt tokens looked up in the prefix cache (0 while caching is off), as vLLM counts."""
    prefix_cache_hits_total: int
    """Of those, the tokens found cached (not prefilled again)."""
    steps: int
    """Engine steps run so far; it stays put while the engine is idle."""


class EngineObserver:
    """Hooks for metrics; the default does nothing. Times are ``loop.time()`` seconds."""

    def on_prefill(self, seq: Sequence, queue_time_s: float) -> None: ...

    def on_tokens(self, batch: list[Sequence], interval_s: float, now: float) -> None:
        """One token went to each sequence of ``batch``; ``interval_s`` since the last step."""

    def on_finish(self, seq: Sequence, now: float) -> None: ...


class Sequence:
    """One request inside the engine; its HTTP handler waits on it for tokens."""

    __slots__ = (
        "_wakeup",
        "admitted_at",
        "arrival_order",
        "arrived_at",
        "cached_tokens",
        "delivered",
        "first_token_at",
        "generated",
        "max_tokens",
        "model",
        "prefix_blocks",
        "priority",
        "prompt_tokens",
        "request_id",
        "state",
    )

    def __init__(
        self,
        request_id: str,
        model: str,
        prompt_tokens: int,
        max_tokens: int,
        priority: int,
        arrival_order: int,
        arrived_at: float,
        prefix_blocks: tuple[int, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.prefix_blocks = prefix_blocks
        """Chained hashes of the prompt's whole blocks (what the prefix cache is keyed by)."""
        self.cached_tokens = 0
        """Leading prompt tokens found in the prefix cache when the sequence was admitted."""
        self.max_tokens = max_tokens
        self.priority = priority
        self.arrival_order = arrival_order
        self.arrived_at = arrived_at
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.generated = 0
        self.delivered = 0
        self.state = SequenceState.WAITING
        self._wakeup = asyncio.Event()

    @property
    def done(self) -> bool:
        return self.state in (SequenceState.FINISHED, SequenceState.ABORTED)

    async def next_tokens(self) -> int:
        """Wait for tokens not yet handed out and return how many; 0 once the sequence is done.

        Returning a count rather than one token at a time lets a lagging reader catch up in one
        write instead of one write per token.
        """
        while True:
            fresh = self.generated - self.delivered
            if fresh:
                self.delivered = self.generated
                return fresh
            if self.done:
                return 0
            self._wakeup.clear()
            await self._wakeup.wait()

    async def wait_done(self) -> None:
        while not self.done:
            self._wakeup.clear()
            await self._wakeup.wait()

    def _notify(self) -> None:
        self._wakeup.set()


class EmulatedEngine:
    """The batching engine. One loop task, started on the first request, sleeps while idle."""

    def __init__(
        self,
        config: EmulatorConfig,
        observer: EngineObserver | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self.faults = dataclasses.replace(config.faults)
        self.observer = observer or EngineObserver()
        self._clock = clock
        self._heap: list[tuple[int, int, Sequence]] = []
        self._waiting_count = 0  # live sequences in the heap; aborted ones are removed lazily
        self._waiting_by_model: dict[str, int] = dict.fromkeys(config.models, 0)
        self._running: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._work_available: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False
        self._max_waiting_seen = 0
        self._max_running_seen = 0
        self._received_count = 0
        self._finished_count = 0
        self._aborted_count = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._prefix_cache_queries_total = 0
        self._prefix_cache_hits_total = 0
        self.prefix_cache = PrefixCache(config.prefix_cache_blocks, config.block_tokens)
        self._steps = 0
        self._last_emit_at: float | None = None
        self.received: deque[ReceivedRequest] = deque(maxlen=config.request_log_size)
        """Requests in the order they reached the engine."""
        self.finished: deque[str] = deque(maxlen=config.request_log_size)
        """Request ids in the order they finished (aborted ones are not listed)."""

    # ----------------------------------------------------------------- public API

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            waiting=self._waiting_count,
            running=len(self._running),
            max_waiting_seen=self._max_waiting_seen,
            max_running_seen=self._max_running_seen,
            requests_received=self._received_count,
            requests_finished=self._finished_count,
            requests_aborted=self._aborted_count,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            prefix_cache_queries_total=self._prefix_cache_queries_total,
            prefix_cache_hits_total=self._prefix_cache_hits_total,
            steps=self._steps,
        )

    @property
    def loop_started(self) -> bool:
        """Whether the engine loop task exists (it is created by the first request)."""
        return self._loop_task is not None

    def waiting_by_model(self) -> dict[str, int]:
        return dict(self._waiting_by_model)

    def running_by_model(self) -> dict[str, int]:
        counts = dict.fromkeys(self.config.models, 0)
        for seq in self._running.values():
            counts[seq.model] += 1
        return counts

    def kv_tokens_by_model(self) -> dict[str, int]:
        tokens = dict.fromkeys(self.config.models, 0)
        for seq in self._running.values():
            tokens[seq.model] += seq.prompt_tokens + seq.generated
        return tokens

    def submit(
        self,
        request_id: str,
        model: str,
        prompt_tokens: int,
        max_tokens: int,
        priority: int = 0,
        user: str | None = None,
        prefix_blocks: tuple[int, ...] = (),
    ) -> Sequence:
        """Queue a request; the caller then awaits tokens on the returned sequence."""
        if self._closed:
            raise EngineClosedError("the emulated engine is closed")
        if model not in self._waiting_by_model:
            raise KeyError(model)
        if priority != 0 and self.config.policy != "priority":
            raise ValueError("priority scheduling is not enabled (policy is 'fcfs')")
        order = next(self._arrivals)
        seq = Sequence(
            request_id,
            model,
            prompt_tokens,
            max_tokens,
            priority,
            order,
            self._now(),
            prefix_blocks,
        )
        # FIFO is the priority heap with every priority equal: the arrival order decides.
        rank = priority if self.config.policy == "priority" else 0
        heapq.heappush(self._heap, (rank, order, seq))
        self._waiting_count += 1
        self._waiting_by_model[model] += 1
        self._received_count += 1
        self.received.append(
            ReceivedRequest(request_id, model, priority, prompt_tokens, max_tokens, user)
        )
        self._ensure_loop_task().set()
        return seq

    def abort(self, seq: Sequence) -> None:
        """Free the sequence's slot (client went away). A no-op once the sequence is done."""
        if seq.done:
            return
        if seq.state is SequenceState.WAITING:
            self._waiting_count -= 1
            self._waiting_by_model[seq.model] -= 1
        else:
            self._running.pop(seq.request_id, None)
        seq.state = SequenceState.ABORTED
        self._aborted_count += 1
        seq._notify()

    async def aclose(self) -> None:
        """Stop the loop and abort every queued or running sequence so their handlers end."""
        self._closed = True
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for seq in list(self._running.values()):
            self.abort(seq)
        while self._heap:
            self.abort(heapq.heappop(self._heap)[2])

    # ----------------------------------------------------------------- the loop

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    def _ensure_loop_task(self) -> asyncio.Event:
        if self._work_available is None:
            self._work_available = asyncio.Event()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(
                self._run(self._work_available), name="emulated-engine-loop"
            )
        return self._work_available

    async def _run(self, work_available: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if not self._running and self._waiting_count == 0:
                work_available.clear()
                await work_available.wait()
                deadline = loop.time()
            prefill_tokens = self._admit_waiting()
            step_s = self._step_seconds(prefill_tokens)
            # Pace by deadline so the time spent emitting tokens does not stretch every step.
            now = loop.time()
            deadline = max(deadline, now - step_s) + step_s
            await asyncio.sleep(deadline - now)
            self._emit_one_token_each(step_s)

    def _admit_waiting(self) -> int:
        """Move sequences from the queue into the batch; return prompt tokens to prefill."""
        prefill_tokens = 0
        now = self._now()
        while self._heap and len(self._running) < self.config.max_num_seqs:
            seq = heapq.heappop(self._heap)[2]
            if seq.state is not SequenceState.WAITING:
                continue  # aborted while queued
            self._waiting_count -= 1
            self._waiting_by_model[seq.model] -= 1
            seq.state = SequenceState.RUNNING
            seq.admitted_at = now
            self._running[seq.request_id] = seq
            if self.prefix_cache.capacity:
                seq.cached_tokens = self.prefix_cache.lookup(seq.prefix_blocks, seq.prompt_tokens)
                self._prefix_cache_queries_total += seq.prompt_tokens
                self._prefix_cache_hits_total += seq.cached_tokens
            prefill_tokens += seq.prompt_tokens - seq.cached_tokens
            self._prompt_tokens_total += seq.prompt_tokens
            self.observer.on_prefill(seq, now - seq.arrived_at)
        self._max_running_seen = max(self._max_running_seen, len(self._running))
        # Like vLLM's num_requests_waiting, the queue is measured after each step's scheduling:
        # a request that arrives to a free slot is admitted at the next step, never queued.
        self._max_waiting_seen = max(self._max_waiting_seen, self._waiting_count)
        return prefill_tokens

    def _step_seconds(self, prefill_tokens: int) -> float:
        config = self.config
        step_ms = (
            config.base_step_ms
            + config.step_ms_per_running_seq * len(self._running)
            + config.prefill_ms_per_token * prefill_tokens
        )
        return step_ms * self.faults.slow / self.config.speed / 1000.0

    def _emit_one_token_each(self, step_s: float) -> None:
        now = self._now()
        # Sequences that already had a token got it on the previous step, so this is their ITL.
        interval_s = step_s if self._last_emit_at is None else now - self._last_emit_at
        self._last_emit_at = now
        batch = list(self._running.values())
        for seq in batch:
            seq.generated += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
                # Its prefill is done: later prompts that start the same reuse these blocks.
                self.prefix_cache.insert(seq.prefix_blocks)
            if seq.generated >= seq.max_tokens:
                self._finish(seq, now)
            seq._notify()
        self._generation_tokens_total += len(batch)
        self._steps += 1
        self.observer.on_tokens(batch, interval_s, now)

    def _finish(self, seq: Sequence, now: float) -> None:
        del self._running[seq.request_id]
        seq.state = SequenceState.FINISHED
        self._finished_count += 1
        self.finished.append(seq.request_id)
        self.observer.on_finish(seq, now)
