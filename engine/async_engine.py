"""AsyncLLMEngine: one stepping thread owns the LLMEngine; asyncio code talks to it with commands.

    event loop                                   stepping thread
    generate() --(add command, future)-->        runs commands at a step boundary, then step()
    async for out  <--call_soon_threadsafe--     outputs, per request, into that request's queue

The thread sleeps on a Condition while there is neither work nor a command (no polling); work is a
running request, or unfinished morph work while something changed since the last step boundary (a
target that moves k layers per step keeps stepping an idle engine until it is reached; a restore
waiting for blocks is retried after the step that finished their requests, not in a busy loop). Every engine call happens on the
thread, so the engine needs no locks; the loop never blocks on a step.

What the morph executor did (results of apply() and of every step boundary) goes into a bounded log;
a reader keeps a cursor: `morph_results_since(cursor) -> (cursor, results)`.
A consumer that stops iterating (or is cancelled: client disconnect) aborts its request at once,
freeing its blocks. A request that makes a step raise fails alone (LLMEngine isolates it); the
loop keeps serving.

Admission is decided on the event loop before anything is queued for the thread: more than
`max_num_seqs + max_waiting` live requests is EngineOverloadedError at once (an HTTP 503 in well
under a second), instead of after the current step. The engine's own `max_waiting` check at
add_request stays the authority (KV-bound batches run fewer than max_num_seqs).
Liveness (`check_alive`) reads a heartbeat the thread stamps after every command batch and step, so
a health check never waits behind queued work.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Callable

from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, StepFailed
from engine.heap import release_free_heap
from engine.llm_engine import LLMEngine
from engine.morph.actions import ActionResult, MorphAction, MorphState
from engine.morph.admission import AdmissionGrant, enact
from engine.outputs import RequestOutput
from engine.pressure import PressureSnapshot
from engine.sampling_params import SamplingParams
from engine.step_stats import PrefillRate, StepLog, StepStats

logger = logging.getLogger(__name__)

Command = tuple[Callable[[LLMEngine], Any], "asyncio.AbstractEventLoop | None", "asyncio.Future | None"]


def _consumer_error(out: RequestOutput) -> Exception:
    """What the consumer of a request the engine failed alone raises: the request's own fault stays
    an InvalidRequestError (-> 400); anything else is a StepFailed naming it (-> 500)."""
    if isinstance(out.error, InvalidRequestError):
        return out.error
    return StepFailed((out.request_id,), out.error)


def _settle(fut: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    if fut.done():  # the awaiting coroutine was cancelled meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None,
                 morph_log_len: int = 1024):
        """`morph_log_len`: how many recent morph results are kept for morph_results_since()."""
        if (config is None) == (engine is None):
            raise ValueError("pass exactly one of config or engine")
        if morph_log_len < 1:
            raise ValueError(f"morph_log_len must be at least 1, got {morph_log_len}")
        self.engine = engine if engine is not None else LLMEngine(config)
        self._morph_log: collections.deque[tuple[int, ActionResult]] = collections.deque(maxlen=morph_log_len)
        self._morph_seq = 0
        self._step_log = StepLog()  # what the recent model steps ran, for the iteration metrics
        self._prefill_rate = PrefillRate()  # prompt tokens per wall second of its rounds, for the router
        # Something changed since the last step boundary (a command ran, a step moved layers or
        # produced tokens, which may have freed blocks): pending morph work is worth another step.
        self._morph_moving = False
        self._cond = threading.Condition()
        self._commands: collections.deque[Command] = collections.deque()
        self._sinks: dict[str, Callable[[Any], None]] = {}  # touched only by the stepping thread
        self._stopped = False
        self._dead: BaseException | None = None
        # (snapshot, cutoff): the latest snapshot and the monotonic time of the command drain before it;
        # one tuple, so a reader on the event loop never pairs a snapshot with another round's cutoff.
        self._published = (self.engine.pressure(), time.monotonic())
        self._morph_state = self.engine.morph_state()
        self._live = 0  # requests admitted and not yet finished; touched only on the event loop
        self._heartbeat = time.monotonic()  # stamped by the stepping thread after every round
        self._thread = threading.Thread(target=self._run, name="morphserve-engine", daemon=True)
        self._thread.start()

    # -- facts (immutable after start) -------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def base_kv_blocks(self) -> int:
        """KV blocks committed at start, with every layer at its starting precision: what the cache
        shrinks back to once every layer a restore may give back is restored."""
        return self.engine.memory_plan.capacity

    def pressure(self) -> PressureSnapshot:
        """The snapshot taken after the latest step or command."""
        return self._published[0]

    def pressure_with_cutoff(self) -> tuple[PressureSnapshot, float]:
        """The latest snapshot and its cutoff (time.monotonic): every request posted before the cutoff
        is in the snapshot, none posted after it. The cutoff is when the thread took the commands of the
        round that produced the snapshot, i.e. *before* that round's step: a request posted during a step
        (a 512-token prefill chunk takes ~0.65 s on one thread) is in neither the snapshot published
        at the step's end nor anything older, so whoever counts what it sent since a snapshot (the
        pressure-aware router) must count from the cutoff, not from the snapshot's own time."""
        return self._published

    def prefill_tokens_per_s(self) -> float:
        """Recent prefill speed (engine/step_stats.py PrefillRate); 0 before the first prefill."""
        return self._prefill_rate.tokens_per_s

    def morph_state(self) -> MorphState:
        return self._morph_state

    def morph_results_since(self, cursor: int = 0) -> tuple[int, tuple[ActionResult, ...]]:
        """What the morph executor did after `cursor` (0: everything still kept), oldest first, and the
        cursor to pass next time. Results older than the log's length are dropped."""
        with self._cond:
            return self._morph_seq, tuple(r for seq, r in self._morph_log if seq > cursor)

    def drain_step_stats(self) -> list[StepStats]:
        """The model steps' records since the last call, oldest first (bounded); any thread."""
        return self._step_log.drain()

    def _log_morph(self, results: tuple[ActionResult, ...] | list[ActionResult]) -> None:
        with self._cond:
            for result in results:
                self._morph_seq += 1
                self._morph_log.append((self._morph_seq, result))

    @property
    def capacity(self) -> int:
        """Live requests this engine admits: a full batch plus a full waiting queue."""
        return self.engine.config.max_num_seqs + self.engine.config.max_waiting

    @property
    def num_live(self) -> int:
        return self._live

    def check_alive(self, stall_s: float) -> None:
        """Raise EngineDeadError when the stepping thread is dead, or has had work but finished no
        round for `stall_s` seconds (a hung step). Never waits for the thread."""
        if self._dead is not None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine loop stopped: {self._dead!r}")
        silent_s = time.monotonic() - self._heartbeat
        busy = self._live > 0 or bool(self._commands)
        if busy and silent_s > stall_s:
            raise EngineDeadError(f"the engine finished no step in {silent_s:.1f} s (limit {stall_s} s)")

    # -- asyncio API -------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        if self._live >= self.capacity:
            raise EngineOverloadedError(f"{self._live} requests are in this engine (max_num_seqs + max_waiting = "
                                        f"{self.capacity}); retry later")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(item: Any) -> None:  # called on the stepping thread
            loop.call_soon_threadsafe(queue.put_nowait, item)

        grammar = None
        if params is not None and params.structured_output is not None:  # compiling may take seconds:
            grammar = await asyncio.to_thread(self.engine.compile_grammar, params.structured_output)  # not in a step
        refused = False  # the engine raised at add_request: nothing of ours to abort (the id may be another's)

        def add(engine: LLMEngine) -> None:
            nonlocal refused
            try:
                engine.add_request(request_id, prompt, params, grammar)
            except BaseException:
                refused = True
                raise
            self._sinks[request_id] = sink

        self._live += 1
        finished = False
        try:
            await self.run_at_step_boundary(add)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._live -= 1
            # Consumer went away (aclose, cancellation, error): free the blocks now. Cancelled while
            # the add was still queued, the abort queues behind it (commands run in order).
            if not finished and not refused:
                self._post((lambda engine: self._abort(request_id), None, None))

    async def apply(self, action: MorphAction) -> ActionResult:
        """Run a morph action on the stepping thread at the next step boundary. What is left of it
        continues at the following step boundaries, also while no request runs."""
        def run(engine: LLMEngine) -> ActionResult:
            result = engine.apply(action)
            self._log_morph((result,))
            return result
        return await self.run_at_step_boundary(run)

    async def enact(self, grant: AdmissionGrant | None, action: MorphAction | None,
                    seen_moves: int) -> ActionResult | None:
        """A directive at the next step boundary (engine/morph/admission.py `enact`); the target's result."""
        def run(engine: LLMEngine) -> ActionResult | None:
            result, admitted = enact(engine, grant, action, seen_moves)
            self._log_morph([r for r in (result, admitted) if r is not None])
            return result
        return await self.run_at_step_boundary(run)

    async def abort(self, request_id: str) -> None:
        await self.run_at_step_boundary(lambda engine: self._abort(request_id))

    async def run_at_step_boundary(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine) on the stepping thread between two steps; its result (or exception) comes back."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._post((fn, loop, fut))
        return await fut

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the stepping thread, then the engine's own workers (the morph prefetch thread)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self.engine.close()

    # -- the stepping thread -----------------------------------------------------------------
    def _post(self, command: Command) -> None:
        with self._cond:
            if self._dead is not None or self._stopped:
                fn, loop, fut = command
                if fut is not None:
                    loop.call_soon_threadsafe(_settle, fut, None, EngineDeadError("the engine is shut down"))
                return
            self._commands.append(command)
            self._cond.notify()

    def _run(self) -> None:
        stepped = False
        busy_since: float | None = None  # the previous round's end, when it left work for this one
        try:
            while True:
                with self._cond:
                    waited = False
                    while not (self._stopped or self._commands or self._has_work()):
                        self._cond.wait()
                        waited = True
                    if self._stopped:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                    cutoff = time.monotonic()
                # A round that follows a busy one starts where that one ended: the gap between them is
                # part of what draining the queue takes (PrefillRate).
                round_start = busy_since if busy_since is not None and not waited else cutoff
                for command in commands:
                    self._run_command(command)
                self._morph_moving = self._morph_moving or bool(commands)
                prefilled = 0
                if self._has_work():
                    prefilled = self._step()
                    stepped = True
                self._published = (self.engine.pressure(), cutoff)
                self._morph_state = self.engine.morph_state()
                self._heartbeat = time.monotonic()
                self._prefill_rate.record(prefilled, self._heartbeat - round_start)
                working = self._has_work()
                busy_since = self._heartbeat if working else None
                if stepped and not working:  # busy -> idle: hand the batch's freed heap back
                    release_free_heap()
                    stepped = False
        except BaseException as e:  # a bug in the loop itself: nothing can be served any more
            logger.exception("engine loop died")
            self._dead = e
        finally:
            self._fail_everything(EngineDeadError("the engine stopped; retry on another replica"))

    def _run_command(self, command: Command) -> None:
        fn, loop, fut = command
        try:
            result, error = fn(self.engine), None
        except Exception as e:
            result, error = None, e
            if fut is None:
                logger.exception("engine command failed")
        if fut is not None:
            try:
                loop.call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:  # that event loop is closed; nobody is waiting any more
                pass

    def _has_work(self) -> bool:
        return self.engine.has_unfinished() or (self._morph_moving and self.engine.has_pending_morph())

    def _step(self) -> int:
        """One engine step, its outputs delivered; returns the prompt tokens it prefilled."""
        try:
            result = self.engine.step()
        except Exception as e:  # outside the model step: reset every request to stay consistent
            logger.exception("engine step failed outside the model; failing requests %s", list(self._sinks))
            self._morph_moving = False  # do not retry a failing morph action in a loop while idle
            for rid in list(self._sinks):
                self.engine.abort(rid)
                self._deliver(rid, e, last=True)
            return 0
        self._log_morph(result.morph_results)
        if result.stats is not None:
            self._step_log.record(result.stats)
        self._morph_moving = bool(result.morph_results or result.outputs)  # a failed request freed blocks too
        for out in result.outputs:
            if out.error is not None:  # the engine failed this request alone (already aborted)
                self._deliver(out.request_id, _consumer_error(out), last=True)
            else:
                self._deliver(out.request_id, out, last=out.finished)
        return result.stats.num_prefill_tokens if result.stats is not None else 0

    def _deliver(self, request_id: str, item: Any, last: bool) -> None:
        sink = self._sinks.pop(request_id, None) if last else self._sinks.get(request_id)
        if sink is None:
            return
        try:
            sink(item)
        except RuntimeError:  # the consumer's event loop is gone: nobody will read this request
            self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self.engine.abort(request_id)

    def _fail_everything(self, error: BaseException) -> None:
        with self._cond:
            self._stopped = True
            commands = list(self._commands)
            self._commands.clear()
        for fn, loop, fut in commands:
            if fut is not None:
                try:
                    loop.call_soon_threadsafe(_settle, fut, None, error)
                except RuntimeError:
                    pass
        for rid in list(self._sinks):
            self._deliver(rid, error, last=True)
