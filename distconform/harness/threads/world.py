"""Shared state of one threaded run: the baton, rank states, collective meetings, abort.

Why a baton. torch's default CPU generator, Python's ``random`` and numpy's legacy global
generator are process-wide, so N rank threads running freely draw from one interleaved
stream: what rank 1 gets depends on scheduling (the known defect of torch's
MultiThreadedTestCase, pytorch#137270). Here exactly one rank thread runs at a time: it
holds the baton, and gives it up only where it would block anyway (waiting for a collective,
a point-to-point peer or a store key) or when it finishes. On each hand-over the generator
states of the outgoing rank are saved and the incoming rank's are restored, so every rank
sees its own uninterrupted stream, identical to what a separate process would see,
whatever the interleaving. Saving is lazy (only when a *different* rank takes the baton),
so a rank that re-takes the baton after its own wait pays nothing.

The cost is parallelism, which on a 2-core CPU box running small test models is worth
little; the gain is determinism and correctness of every RNG-dependent test. A rank thread
that blocks on anything else (``time.sleep``, a lock, I/O that never completes) keeps the
baton and stalls the others: the runner's deadline reports it as hung, with stacks.

Not isolated: CUDA generators (thread ranks are a CPU tier), numpy imported only after a
run started, and other process-wide settings (default dtype, ``torch.set_num_threads``,
deterministic-algorithm flags): a rank that changes them changes them for all.

One wait is not a blocking point the baton sees: torch's C++ waiting on a future without
returning to Python (DDP's reducer waits for its buckets' all-reduce futures at the end of
backward). A rank that takes a future of an unfinished collective therefore *yields*
(:meth:`ThreadWorld.yield_until`): the others run until the collective completes, or until
none of them can run, when the yielding rank resumes with the future still pending, as it
would on any backend. The interleaving stays a function of the program alone.

Because only the baton holder runs and every blocking point is known, a global deadlock is
detected immediately: when no rank holds or waits for the baton and every unfinished rank
waits for something that is not ready, nothing can ever change, so the run is aborted with
a description of what each rank waits for (no need to wait for the deadline). One exception:
a rank whose wait has a timeout ending within :data:`SHORT_TIMEOUT_S` (a group made with a
short timeout, as error-handling tests do) will wake with a TimeoutError, as on any backend,
and may then unblock the others; its timeout is left to fire.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

# Rank thread states (plain ints: checked on every hand-over).
STARTING = 0  # thread created, not yet holding the baton for the first time
RUNNABLE = 1  # waiting for the baton
RUNNING = 2  # holds the baton
BLOCKED = 3  # gave the baton up, waits for a collective / peer / store key
DONE = 4

_STATE_NAMES = {STARTING: "starting", RUNNABLE: "runnable", RUNNING: "running"}

#: A blocked rank whose timeout ends sooner than this is not deadlocked: it will time out.
#: Longer timeouts (the 30-minute default of every group) would only delay the report.
SHORT_TIMEOUT_S = 60.0


class RankAbortedError(RuntimeError):
    """A rank's pending (or next) collective was released because another rank failed."""

    def __init__(self, message: str, failed_rank: int | None) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank


class CollectiveDeadlockError(RuntimeError):
    """Every unfinished rank waits for something no rank can provide any more."""


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group issued different collectives at the same position."""


class RunAbandonedError(RuntimeError):
    """The run passed its deadline; waiting ranks are released without the baton."""


class BatonError(RuntimeError):
    """A collective was issued from a thread that is not the running rank thread."""


def copy_error(error: BaseException, message: str) -> BaseException:
    """A fresh exception like ``error`` for another rank to raise.

    One exception object raised on several threads would have its traceback rewritten by
    each; every rank gets its own, of the same type when the type allows it.
    """
    try:
        copy = type(error)(message)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {message}")
    return copy if isinstance(copy, BaseException) else RuntimeError(message)


_context = threading.local()


def current_rank() -> tuple[ThreadWorld, int] | None:
    """(world, global rank) of the calling rank thread, or None outside rank threads."""
    world = getattr(_context, "world", None)
    return None if world is None else (world, _context.rank)


def bind_rank(world: ThreadWorld | None, rank: int = -1) -> None:
    _context.world = world
    _context.rank = rank


@functools.lru_cache(maxsize=16)
def _seeded_states(seed: int, with_numpy: bool) -> tuple[Any, ...]:
    """The global generators' states right after seeding them all with ``seed``.

    Built on private generator objects (the same seeding algorithms as
    ``torch.manual_seed``/``random.seed``/``numpy.random.seed``) and cached: seeding the
    globals costs ~0.5 ms per run, mostly in ``torch.manual_seed``'s accelerator hooks.
    """
    torch_state = torch.Generator().manual_seed(seed).get_state()
    np_state = None
    if with_numpy:
        np_state = sys.modules["numpy"].random.RandomState(seed).get_state()
    return torch_state, random.Random(seed).getstate(), np_state


class _RngStates:
    """Per-rank copies of the process-global generator states (see module docstring)."""

    def __init__(self, world_size: int, seed: int) -> None:
        self._numpy = sys.modules.get("numpy")
        # The numpy state known to be loaded, and its generator's raw bytes at that time.
        self._numpy_loaded: tuple[Any, Any, bytes] | None = None
        self._caller = self._capture()
        seeded = _seeded_states(seed, self._numpy is not None)
        # States are immutable snapshots (restoring copies them), so ranks may share one.
        self._slots = [seeded] * world_size
        self._live: int | None = None  # whose state is in the generators now; None: caller

    def _capture(self) -> tuple[Any, ...]:
        np_state = self._numpy_state() if self._numpy is not None else None
        return torch.get_rng_state(), random.getstate(), np_state

    def _numpy_state(self) -> Any:
        """numpy's legacy global state, read again only if its generator moved.

        ``get_state`` costs 40 us, on every hand-over to another rank. Equal raw bytes of
        the Mersenne Twister (key and position) since a state was loaded mean that nothing
        was drawn; a cached Gaussian can still be used up without a draw, so a state that
        holds one is always read again.
        """
        loaded = self._numpy_loaded
        if loaded is not None and not loaded[0][3]:
            state, bits, raw = loaded
            if self._numpy.random.get_bit_generator() is bits and _raw_mt19937(bits) == raw:
                return state
        state = self._numpy.random.get_state()
        self._remember_numpy(state)
        return state

    def _remember_numpy(self, state: Any) -> None:
        bits = self._numpy.random.get_bit_generator()  # type: ignore[union-attr]
        raw = _raw_mt19937(bits)
        self._numpy_loaded = (state, bits, raw) if raw is not None else None

    def _restore(self, state: tuple[Any, ...], current: tuple[Any, ...]) -> None:
        """Load ``state`` into the generators, which hold ``current`` now.

        Restoring Python's and numpy's generators costs ~10 and ~100 us; most tests never
        draw from them, so all ranks' states stay equal and the restore is skipped.
        """
        torch.set_rng_state(state[0])  # ~1 us: cheaper than comparing
        if state[1] is not current[1] and state[1] != current[1]:
            random.setstate(state[1])
        if state[2] is not None and not _same_numpy_state(state[2], current[2]):
            self._numpy.random.set_state(state[2])  # type: ignore[union-attr]
            self._remember_numpy(state[2])

    def switch_to(self, rank: int) -> None:
        if self._live == rank:
            return
        if self._live is None:
            current = self._caller  # nothing ran since the caller's states were captured
        else:
            current = self._slots[self._live] = self._capture()
        self._restore(self._slots[rank], current)
        self._live = rank

    def give_back_to_caller(self) -> None:
        """Put the caller's generator states back; the run leaves them as it found them."""
        if self._live is not None:
            current = self._slots[self._live] = self._capture()
            self._live = None
            self._restore(self._caller, current)


#: numpy's ``mt19937_state``: 624 32-bit words of key and the position in them.
_MT19937_STATE_BYTES = 624 * 4 + 4


def _raw_mt19937(bits: Any) -> bytes | None:
    """The generator's state as raw bytes (numpy's public ctypes view); None for another
    bit generator, whose layout is not known here."""
    if type(bits).__name__ != "MT19937":
        return None
    return ctypes.string_at(bits.ctypes.state_address, _MT19937_STATE_BYTES)


def _same_numpy_state(a: tuple[Any, ...], b: tuple[Any, ...] | None) -> bool:
    # Legacy state: (name, key array, position, has_gauss, cached_gaussian).
    if b is None or a is b:
        return a is b
    return a[0] == b[0] and a[2:] == b[2:] and bool((a[1] == b[1]).all())


class Meeting:
    """One collective (or one send/recv pair) being assembled from its ranks' payloads."""

    __slots__ = ("done", "error", "futures", "op", "params", "payloads", "size", "what")

    def __init__(self, op: str, params: tuple[Any, ...], size: int, what: str) -> None:
        self.op = op
        self.params = params
        self.size = size
        self.what = what
        self.payloads: dict[int, Any] = {}
        self.done = False
        self.error: BaseException | None = None
        self.futures: list[tuple[torch.futures.Future, Any]] = []

    def settled(self) -> bool:
        return self.done or self.error is not None


class ThreadWorld:
    """Everything the rank threads of a runner share: one instance for as long as runs
    pass (:meth:`begin_run` between them), a new one after a run that did not.

    The baton is handed over explicitly: a rank that gives it up picks the next runnable
    rank (first come, first served; ranks whose wait is over join the queue in rank
    order) and wakes only that thread. Every hand-over therefore wakes exactly one
    thread (no herd of threads fighting for the GIL to re-check a condition), and the
    interleaving of a run is the same every time it is repeated.
    """

    def __init__(self, world_size: int, seed: int = 0) -> None:
        self.world_size = world_size
        self.lock = threading.Lock()
        self._wake = [threading.Condition(self.lock) for _ in range(world_size)]
        self.main_cond = threading.Condition(self.lock)  # the runner waits here
        # Meetings of each group, keyed by group name then by position (an int for
        # collectives, a tuple for point-to-point pairs).
        self._meetings: dict[str, dict[Any, Meeting]] = {}
        self._p2p_counts: dict[tuple[Any, ...], int] = {}
        self.store_data: dict[str, bytes] = {}
        self.begin_run(seed)

    def begin_run(self, seed: int) -> None:
        """Set up the next run of the same rank threads and process groups.

        Only after a run that passed: its collectives all met (so every group's positions
        and point-to-point counts agree across ranks) and every rank thread has left.
        """
        # Ranks start in rank order: the queue begins with all of them, so a rank thread
        # the OS happens to schedule early still waits for its turn.
        self._queue: collections.deque[int] = collections.deque(range(self.world_size))
        self.owner: int | None = None
        self.state = [STARTING] * self.world_size
        self._waiting_for: list[Callable[[], bool] | None] = [None] * self.world_size
        #: Blocked ranks that may also resume when no other rank can run (they yield).
        self._yielding = [False] * self.world_size
        self._blocked_on: list[str | None] = [None] * self.world_size
        #: When each blocked rank's wait times out (None: it never does).
        self._deadline: list[float | None] = [None] * self.world_size
        self.abort_error: BaseException | None = None
        self.failed_rank: int | None = None
        self.abandoned = False
        self.rng = _RngStates(self.world_size, seed)

    # --- the baton (every method below runs with self.lock held) ----------------------

    def _wait_for_baton(self, rank: int, end: float | None = None) -> bool:
        """Sleep until the baton is handed to ``rank``; False if ``end`` passed first."""
        while self.owner != rank and not self.abandoned:
            remaining = None if end is None else end - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._wake[rank].wait(remaining)
        return True

    def _start_running(self, rank: int) -> None:
        self.state[rank] = RUNNING
        if not self.abandoned:
            # After a hang the holder may never give the baton back; ranks released by the
            # abandon unwind without it, and their RNG streams no longer matter.
            self.rng.switch_to(rank)

    def _queue_rank(self, rank: int) -> None:
        self.state[rank] = RUNNABLE
        self._queue.append(rank)
        if self.owner is None:
            self._hand_off()

    def _release(self, rank: int, new_state: int) -> None:
        self.state[rank] = new_state
        if new_state == DONE and rank in self._queue:
            self._queue.remove(rank)  # a rank thread that died before taking its turn
        if self.owner == rank:
            self.owner = None
            self._hand_off()
        elif new_state == DONE and all(s == DONE for s in self.state):
            self.main_cond.notify_all()

    def _hand_off(self) -> None:
        """Give the free baton to the next runnable rank, detecting deadlocks on the way."""
        for rank, state in enumerate(self.state):
            if state == BLOCKED:
                ready = self._waiting_for[rank]
                if self.abort_error is not None or ready is None or ready():
                    self.state[rank] = RUNNABLE
                    self._queue.append(rank)
        if not self._queue:
            self._resume_a_yielding_rank()
        if not self._queue:
            self._detect_deadlock()
        if self._queue:
            self.owner = self._queue.popleft()
            self._wake[self.owner].notify()
        elif all(s == DONE for s in self.state):
            self.main_cond.notify_all()

    def _resume_a_yielding_rank(self) -> None:
        # Nothing else can run: the lowest yielding rank goes on without what it waited for.
        for rank, state in enumerate(self.state):
            if state == BLOCKED and self._yielding[rank]:
                self.state[rank] = RUNNABLE
                self._queue.append(rank)
                return

    def _detect_deadlock(self) -> None:
        # Called with no runnable rank and nobody holding the baton: if no rank is still
        # starting and some wait, nothing can ever make their waits come true.
        if self.abort_error is not None or STARTING in self.state:
            return
        blocked = [rank for rank, state in enumerate(self.state) if state == BLOCKED]
        if not blocked:
            return
        soon = time.monotonic() + SHORT_TIMEOUT_S
        if any((end := self._deadline[rank]) is not None and end < soon for rank in blocked):
            return  # that rank wakes with its TimeoutError and may unblock the rest
        lines = [
            f"  rank {rank}: finished"
            if state == DONE
            else f"  rank {rank}: waits in {self._blocked_on[rank]}"
            for rank, state in enumerate(self.state)
        ]
        self.abort_error = CollectiveDeadlockError(
            "deadlock: every unfinished rank waits for a collective that can never "
            "complete\n" + "\n".join(lines)
        )
        for rank in blocked:
            self.state[rank] = RUNNABLE
            self._queue.append(rank)

    def enter(self, rank: int) -> None:
        """Called first thing on a rank thread: wait for the baton."""
        with self.lock:
            if self.owner is None and self._queue and self._queue[0] == rank:
                self.owner = self._queue.popleft()
            self._wait_for_baton(rank)
            self._start_running(rank)

    def leave(self, rank: int) -> None:
        """Called last thing on a rank thread."""
        with self.lock:
            self._release(rank, DONE)

    def all_done(self) -> bool:
        return all(s == DONE for s in self.state)

    def has_left(self, rank: int) -> bool:
        with self.lock:
            return self.state[rank] == DONE

    def _check_running(self, rank: int, what: str) -> None:
        if self.owner != rank and not self.abandoned:
            raise BatonError(
                f"{what} issued by rank {rank} from a thread that does not hold the baton "
                f"(thread {threading.current_thread().name!r}); collectives of a threaded "
                f"rank must be issued from that rank's own thread"
            )

    # --- abort ---------------------------------------------------------------------------

    def fail(self, rank: int, error: BaseException) -> None:
        """A rank failed: every pending and future wait of the other ranks raises."""
        with self.lock:
            if self.abort_error is None:
                self.abort_error = error
                self.failed_rank = rank
            # The waiting ranks join the queue when this rank gives the baton up.
            if self.owner is None:
                self._hand_off()

    def abandon(self, reason: str) -> None:
        """Deadline passed: release waiting ranks, even without the baton."""
        with self.lock:
            if self.abort_error is None:
                self.abort_error = RunAbandonedError(reason)
            self.abandoned = True
            for wake in self._wake:
                wake.notify_all()

    def _aborted(self, what: str) -> BaseException:
        error = self.abort_error
        if isinstance(error, CollectiveDeadlockError):
            return CollectiveDeadlockError(str(error))
        if isinstance(error, RunAbandonedError):
            return RankAbortedError(f"{what} aborted: {error}", None)
        # A wrapper that carries a failure already recorded elsewhere names it itself.
        summary = getattr(error, "abort_summary", None) or f"{type(error).__name__}: {error}"
        return RankAbortedError(
            f"{what} aborted because rank {self.failed_rank} failed: {summary}",
            self.failed_rank,
        )

    # --- blocking --------------------------------------------------------------------------

    def wait_until(
        self, rank: int, ready: Callable[[], bool], what: str, timeout: float | None = None
    ) -> None:
        """Block rank (baton given up) until ``ready()``; raise if the run aborts first."""
        with self.lock:
            self._check_running(rank, what)
            if ready():
                return
            if self.abort_error is not None:
                raise self._aborted(what)
            end = None if timeout is None else time.monotonic() + timeout
            in_time = self._block(rank, ready, what, end=end)
            if ready():
                return
            if not in_time:
                raise TimeoutError(f"{what} did not complete within {timeout} s")
            raise self._aborted(what)

    def yield_until(self, rank: int, ready: Callable[[], bool], what: str) -> bool:
        """Let the other ranks run until ``ready()`` or until none of them can run; True if
        ``ready()``. Only the running rank's own thread yields (from any other thread this
        returns at once); raises if the run aborts meanwhile."""
        here = current_rank()
        with self.lock:
            if here != (self, rank) or self.owner != rank or ready():
                return ready()
            if self.abort_error is not None:
                raise self._aborted(what)
            self._block(rank, ready, what, yielding=True)
            if ready():
                return True
            if self.abort_error is not None:
                raise self._aborted(what)
            return False

    def _block(
        self,
        rank: int,
        ready: Callable[[], bool],
        what: str,
        end: float | None = None,
        yielding: bool = False,
    ) -> bool:
        """Give the baton up until a hand-over gives it back; False if ``end`` came first (the
        rank then queues for the baton like any runnable rank)."""
        self._waiting_for[rank] = ready
        self._blocked_on[rank] = what
        self._deadline[rank] = end
        self._yielding[rank] = yielding
        in_time = True
        try:
            self._release(rank, BLOCKED)
            if not self._wait_for_baton(rank, end):
                if self.state[rank] == BLOCKED:  # not already queued by a hand-off
                    in_time = False
                    self._queue_rank(rank)
                self._wait_for_baton(rank)
        finally:
            self._waiting_for[rank] = None
            self._blocked_on[rank] = None
            self._deadline[rank] = None
            self._yielding[rank] = False
        self._start_running(rank)
        return in_time

    # --- meetings --------------------------------------------------------------------------

    def join(
        self,
        rank: int,
        group: str,
        key: Any,
        op: str,
        params: tuple[Any, ...],
        size: int,
        slot: int,
        payload: Any,
        execute: Callable[[dict[int, Any]], None],
        what: str,
    ) -> Meeting:
        """Deposit this rank's payload; the last arrival moves the data for everyone."""
        with self.lock:
            self._check_running(rank, what)
            if self.abort_error is not None:
                raise self._aborted(what)
            meetings = self._meetings.setdefault(group, {})
            meeting = meetings.get(key)
            if meeting is None:
                meeting = meetings[key] = Meeting(op, params, size, what)
            elif meeting.error is None and (meeting.op, meeting.params) != (op, params):
                meeting.error = CollectiveMismatchError(
                    f"group {group!r} position {key}: ranks disagree on the collective: "
                    f"{meeting.what} with {meeting.params} vs {what} with {params}"
                )
            if meeting.error is not None:
                raise copy_error(meeting.error, str(meeting.error))
            if slot in meeting.payloads:
                raise RuntimeError(f"{what}: slot {slot} joined twice (internal error)")
            meeting.payloads[slot] = payload
            if len(meeting.payloads) == meeting.size:
                del meetings[key]
                try:
                    with torch.no_grad():
                        execute(meeting.payloads)
                except BaseException as error:
                    meeting.error = error
                    for future, _ in meeting.futures:
                        future.set_exception(error)
                else:
                    meeting.done = True
                    for future, value in meeting.futures:
                        future.set_result(value)
                # Ranks waiting for this meeting join the queue at the next hand-over.
            return meeting

    def next_p2p_index(self, key: tuple[Any, ...]) -> int:
        """n-th send from src to dst with a tag pairs with the n-th matching recv."""
        with self.lock:
            index = self._p2p_counts.get(key, 0)
            self._p2p_counts[key] = index + 1
            return index

    def pending_meetings(self) -> list[str]:
        """Collectives some ranks issued and others never joined (for end-of-run checks)."""
        with self.lock:
            return [
                f"{m.what} on group {group!r}: joined by {sorted(m.payloads)} of {m.size}"
                for group, meetings in self._meetings.items()
                for m in meetings.values()
                if m.error is None
            ]

    def describe_states(self) -> dict[int, str]:
        with self.lock:
            return {
                rank: (
                    f"waits in {self._blocked_on[rank]}"
                    if state == BLOCKED
                    else ("finished" if state == DONE else _STATE_NAMES[state])
                )
                for rank, state in enumerate(self.state)
            }
