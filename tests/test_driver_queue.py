"""The driver-queue engine with a submission thread (what CUDA's engine is) on a fake driver that runs each
command as it is enqueued: waits across engines of a kind, host waits, failures and ranges, without a GPU.
(The engine without a submission thread is CL's, which tests/test_cl.py runs through PoCL.)"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from aruntime.backends._driver_queue import Span, ThreadedDriverEngine
from aruntime.engine import EXEC, Command, CommandQueue, CopyFault, Op, TimelineSignal
from aruntime.errors import DependencyError, DeviceError, FileTruncated, OpError
from aruntime.events import recorder


class FakeEngine(ThreadedDriverEngine):
    """A driver whose device runs each command at once on the submission thread; an event is its clock tick."""

    def __init__(self, name: str) -> None:
        super().__init__(name, "compute", 5.0)
        self.clock = 0
        self.device_waits: list[int] = []
        self.failing: set[int] = set()  # ticks whose events report a failure
        self.slow: dict[int, threading.Event] = {}  # ticks whose events pass once the threading.Event is set
        self._start()

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _marker(self, timed: bool, wait_for: list[Any]) -> Any:
        return self._tick()

    def _command(self, cmd: Command, wait_for: list[Any]) -> tuple[Any, Span | None]:
        start = self._tick()
        cmd[2](*cmd[3])
        end = self._tick()
        return end, (cmd[1], start, end)

    def _order_after(self, event: Any, wait_for: list[Any]) -> None:
        self.device_waits.append(event)

    def _wait_event(self, event: Any) -> BaseException | None:
        if event in self.slow:
            self.slow[event].wait(5)
        return RuntimeError(f"event {event} failed") if event in self.failing else None

    def _clock_us(self, event: Any) -> float:
        return float(event)

    def _span_ns(self, start: Any, end: Any) -> tuple[int, int]:
        return start * 1000, end * 1000


@pytest.fixture
def engines() -> Iterator[tuple[FakeEngine, FakeEngine]]:
    pair = (FakeEngine("FAKE"), FakeEngine("FAKE:1"))
    yield pair
    for engine in pair:
        engine.close()


def test_ops_complete_in_order_and_record_their_ranges(engines: tuple[FakeEngine, FakeEngine]) -> None:
    engine, _ = engines
    ran: list[int] = []
    recorder.enabled = True
    try:
        ops = [engine.submit(CommandQueue().exec(f"k{i}", ran.append, (i,)), Op(f"k{i}")) for i in range(3)]
        ops[-1].wait_done(5)
    finally:
        recorder.enabled = False
    assert ran == [0, 1, 2] and all(op.done() and op.error is None for op in ops)
    assert engine.ranges.names == ["k0", "k1", "k2"]
    assert engine.ranges.starts[0] == 1000 and engine.ranges.ends[0] == 2000
    assert not engine._events  # every end event forgotten once its op is complete


def test_a_wait_on_an_engine_of_the_kind_is_ordered_on_the_device(engines: tuple[FakeEngine, FakeEngine]) -> None:
    first, second = engines
    release = threading.Event()
    first.slow[first.clock + 2] = release  # the producer's end: its op is not complete until released
    producer = first.submit(CommandQueue().exec("produce", lambda: None), Op("produce"))
    consumer = second.submit(CommandQueue().wait(first.signal, producer.value), Op("consume"))
    consumer.wait_done(5)  # without a host wait: the producer's op is not complete yet
    assert second.device_waits == [first.clock] and not producer.done()
    release.set()
    producer.wait_done(5)
    assert producer.error is None and consumer.error is None


def test_a_host_wait_sets_what_the_op_signalled_before_it(engines: tuple[FakeEngine, FakeEngine]) -> None:
    engine, _ = engines
    gate, progress = TimelineSignal("gate", 5.0), TimelineSignal("progress", 5.0)
    ran = threading.Event()
    op = engine.submit(CommandQueue().signal(progress, 1).wait(gate, 1).exec("after", ran.set), Op("replay"))
    progress.wait(1, 5)  # set while the submission thread still waits for the gate
    assert not ran.is_set() and not op.done()
    gate.set(1)
    op.wait_done(5)
    assert ran.is_set() and op.error is None


def test_a_refused_command_fails_its_op_sets_its_signals_and_the_queue_goes_on(
    engines: tuple[FakeEngine, FakeEngine],
) -> None:
    engine, _ = engines
    after = TimelineSignal("after", 5.0)

    def refuse() -> None:
        raise ValueError("the driver refused it")

    bad = engine.submit(CommandQueue().exec("bad", refuse).signal(after, 1), Op("bad"))
    good = engine.submit(CommandQueue().exec("good", lambda: None), Op("good"))
    good.wait_done(5)
    assert isinstance(bad.error, OpError) and isinstance(bad.error.__cause__, ValueError)
    assert after.value == 1 and good.error is None


def test_a_staged_copy_that_meets_a_truncated_file_fails_its_op_with_file_truncated(
    engines: tuple[FakeEngine, FakeEngine],
) -> None:
    engine, _ = engines

    def staged() -> None:  # what the staging ring raises where its guarded host copy faulted on the destination
        raise CopyFault(2)

    bad = engine.submit(CommandQueue().exec("transfer 8 B FAKE->DISK:/f", staged), Op("transfer 8 B FAKE->DISK:/f"))
    good = engine.submit(CommandQueue().exec("good", lambda: None), Op("good"))
    good.wait_done(5)
    assert isinstance(bad.error, FileTruncated) and isinstance(bad.error, DeviceError) and good.error is None
    assert str(bad.error).startswith("transfer 8 B FAKE->DISK:/f failed on FAKE compute queue: its destination")


def test_a_failed_event_fails_its_op_and_its_readers(engines: tuple[FakeEngine, FakeEngine]) -> None:
    engine, _ = engines
    engine.failing.add(engine.clock + 2)  # the end of the next op's kernel
    bad = engine.submit(CommandQueue().exec("bad", lambda: None), Op("bad"))
    reader = Op("reader")
    reader.inputs = (bad,)
    engine.push([(EXEC, "read", lambda: None, ())], reader)
    reader.wait_done(5)
    assert isinstance(bad.error, OpError) and "failed" in str(bad.error.__cause__)
    assert isinstance(reader.error, DependencyError)


def test_closing_joins_both_threads() -> None:
    engine = FakeEngine("FAKE:2")
    threads = list(engine._threads)
    assert [t.name for t in threads] == ["FAKE:2 compute queue submit", "FAKE:2 compute queue"]
    engine.close()
    assert not any(t.is_alive() for t in threads)
