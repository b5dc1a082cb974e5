"""The CUDA hand-over between the training stream and a Comm's stream, checked on CPU
against a recording stand-in for ``torch.cuda``: what is recorded and waited on, and where.
It checks the protocol PyTorch documents (events and ``record_stream``, never a device-wide
synchronise); it cannot show NCCL's behaviour, which needs a GPU (see docs/gpu.md)."""

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch

from loco.comm import streams


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.name))

    def synchronize(self):  # a whole-stream synchronise: must never be called
        raise AssertionError(f"stream {self.name} synchronised")


class FakeEvent:
    """A CUDA event on a stand-in device clock: each ``record`` happens 0.25 s of device time
    after the one before (``at``); ``happened`` says whether the device got there yet."""

    count = 0
    happened = True  # class-wide: a test may hold every event back
    made: list = []

    def __init__(self, log, enable_timing=False):
        FakeEvent.count += 1
        self.name, self.log, self.recorded_on = f"event{FakeEvent.count}", log, None
        self.timing, self.at = enable_timing, None
        FakeEvent.made.append(self)

    def record(self, stream):
        self.recorded_on = stream.name
        self.at = 0.25 * FakeEvent.count  # exact in binary: the tests compare with ==
        self.log.append(("record", self.name, stream.name))

    def query(self):
        self.log.append(("query", self.name))
        return self.happened

    def elapsed_time(self, end):  # milliseconds, as CUDA's; only once both have happened
        assert self.timing and end.timing and end.happened and self.at is not None
        self.log.append(("elapsed_time", self.name, end.name))
        return (end.at - self.at) * 1000

    def synchronize(self):
        self.log.append(("event_synchronize", self.name))


class FakeTensor:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def record_stream(self, stream):
        self.log.append(("record_stream", self.name, stream.name))


@pytest.fixture
def fake_cuda(monkeypatch):
    """A recording ``torch.cuda``; the current stream is per thread, as CUDA's is (every
    thread starts on the training stream)."""
    log, current = [], threading.local()
    training = FakeStream("training", log)

    def now():
        return getattr(current, "stream", training)

    @contextlib.contextmanager
    def use_stream(stream):
        before = now()
        current.stream = stream
        log.append(("enter_stream", stream.name))
        try:
            yield
        finally:
            current.stream = before

    @contextlib.contextmanager
    def use_device(device):
        log.append(("enter_device", str(device)))
        yield

    def forbidden(*a, **k):
        raise AssertionError("torch.cuda.synchronize (device-wide) was called")

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: FakeStream("comm", log))
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: FakeEvent(log, **kw))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: now())
    monkeypatch.setattr(torch.cuda, "stream", use_stream)
    monkeypatch.setattr(torch.cuda, "device", use_device)
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    return log


def test_streams_for_chooses_by_device_type():
    assert type(streams.streams_for(torch.device("cpu"))) is streams.HostSync
    assert streams.HostSync.blocking_completion and not streams.CudaStreams.blocking_completion


def test_cuda_hand_over_uses_events_and_record_stream_only(fake_cuda):
    log = fake_cuda
    s = streams.CudaStreams(torch.device("cuda", 0))
    x, out = FakeTensor("x", log), FakeTensor("out", log)

    ready = s.issue([x])  # caller's thread
    assert ready.recorded_on == "training"
    assert ("record_stream", "x", "comm") in log  # the allocator keeps x for the transfer

    seen = {}

    def body():
        seen["stream"] = torch.cuda.current_stream().name
        return [out]

    result, done = s.run(ready, body)  # the communication thread
    assert seen["stream"] == "comm" and result == [out]
    assert ("enter_device", "cuda:0") in log  # the thread's current device is the Comm's
    assert log.index(("wait_event", "comm", ready.name)) < log.index(("record", done.name,
                                                                      "comm"))
    assert done.recorded_on == "comm"

    assert s.finished(done)  # done(): a query, no blocking
    s.hand_over(done, result)  # wait(): the training stream waits on the event
    assert log[-2:] == [("wait_event", "training", done.name),
                        ("record_stream", "out", "training")]
    s.synchronize(done)  # only with an emulated link: this thread waits for this event
    assert log[-1] == ("event_synchronize", done.name)


def test_an_offloaded_outer_step_waits_on_the_helpers_stream_and_on_events_only(fake_cuda):
    """Offloaded (global copies on the CPU, the model on a GPU): the helper thread has its own
    stream, on which the all-reduce's hand-over waits and Δ̄ is copied to the host; the
    host waits for that copy's event alone; the training stream waits only at the commit,
    for the helper's last event; a spare shadow is written only after the training
    stream's event recorded when it was swapped out (an earlier merge may still read it)."""
    from loco.algorithms.outer_thread import OuterThread

    log = fake_cuda
    outer = OuterThread(torch.device("cpu"), torch.device("cuda", 0))
    global_flat = torch.zeros(4)
    f = SimpleNamespace(delta=torch.arange(4.0), grad=torch.zeros(4), global_flat=global_flat,
                        share=SimpleNamespace(views=[torch.zeros(4)]),
                        outer_optimizer=torch.optim.SGD([global_flat], lr=0.5, momentum=0.9,
                                                        nesterov=True))

    class Handle:  # the all-reduce: its hand-over makes the current stream wait for it
        def wait(self, count=True):
            torch.cuda.current_stream().wait_event(SimpleNamespace(name="allreduce"))

        def count_wait(self, seconds):
            pass

    def step():
        handle = Handle()
        stepped = OuterThread.wait(outer.start(f, handle), handle)
        assert stepped.finite and stepped.ready.recorded_on == "comm"
        return stepped

    stepped = step()
    assert ("wait_event", "comm", "allreduce") in log  # the helper's stream, not training's
    assert not [e for e in log if e[:2] == ("wait_event", "training")]
    copied = [e for e in log if e[0] == "record" and e[2] == "comm"][0][1]
    assert log.index(("event_synchronize", copied)) > log.index(("record", copied, "comm"))
    assert torch.equal(f.grad, f.delta)  # Δ̄ came over
    outer.commit(f, stepped)
    assert ("wait_event", "training", stepped.ready.name) in log
    free = [e for e in log if e[0] == "record" and e[2] == "training"][-1][1]
    assert ("event_synchronize", free) not in log
    step()  # the next sync of this size writes into the swapped-out shadow
    assert ("event_synchronize", free) in log


def test_staging_records_its_copies_on_the_callers_stream_and_the_comm_thread_waits(
        fake_cuda, monkeypatch):
    """A Comm that stages from a GPU (an elastic worker's): the host copies are queued on
    the caller's current stream and an event recorded after them; the Comm's thread, not
    the caller, waits for that event (not for the device) before the transport runs. The
    copies themselves need a GPU (CPU tensors stand in, staged as they are)."""
    import loco

    log = fake_cuda
    waiters = []
    monkeypatch.setattr(FakeEvent, "synchronize", lambda self: waiters.append(
        (self.name, threading.current_thread().name)))
    once = iter([True])  # the caller's tensor, not the copies handed on
    monkeypatch.setattr(streams.HostStaging, "wants", lambda self, ts: next(once, False))

    def fn(ctx):
        ctx.comm.stage_from = torch.device("cuda", 0)
        t = torch.ones(3)
        return ctx.comm.all_reduce_mean(t).wait(), t
    value, t = loco.launch(fn, 1)[0]
    assert value.data_ptr() == t.data_ptr()
    ready = next(e for e in log if e[0] == "record")
    assert ready[2] == "training"  # on the caller's stream, after its copies
    assert waiters == [(ready[1], "loco-comm-replicas-0")]


def test_a_cuda_comm_times_operations_and_waits_on_the_devices_clock(fake_cuda, monkeypatch):
    """On CUDA ``wait()`` returns once the caller's stream is told to wait: an operation's
    ``seconds`` come from the caller's event at issue to the Comm stream's at its end, and
    ``waited`` from events on the caller's stream around the wait, read once they have
    happened (queried, never synchronised), when the totals are read; on the host clock the
    numbers would be near zero. ``update_times(wait=True)``, for a run's summary, waits for
    the events, inside an ``allowed("log")`` region."""
    from loco.comm import hostreads
    from loco.comm.comm import Comm

    log = fake_cuda
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(FakeEvent, "happened", False)
    monkeypatch.setattr(FakeEvent, "made", [])
    comm = Comm(None, 0, 1)  # one worker: the operations run, nothing to send
    comm._streams = streams.CudaStreams(torch.device("cuda", 0))
    handle = comm.all_reduce_mean(torch.ones(4))
    handle.wait()
    rec = handle.record
    assert (rec.seconds, rec.waited) == (0.0, 0.0)  # the device has not got there
    assert comm.totals().seconds == 0.0 and comm.totals().ops == 1
    ready, began, ended = [e for e in FakeEvent.made if e.recorded_on == "training"]
    done, = [e for e in FakeEvent.made if e.recorded_on == "comm"]
    assert all(e.timing for e in (ready, began, ended, done))

    FakeEvent.happened = True
    totals = comm.totals()
    assert rec.seconds == totals.seconds == done.at - ready.at > 0
    assert rec.waited == totals.waited == ended.at - began.at > 0
    assert ("elapsed_time", ready.name, done.name) in log
    assert not [e for e in log if e[0] == "event_synchronize"]

    FakeEvent.happened = False  # a second operation, settled at the summary
    reasons = []

    def synchronize(self):  # the host waits until the device got there
        reasons.append(hostreads.reason())
        self.happened = True
    monkeypatch.setattr(FakeEvent, "synchronize", synchronize)
    comm.all_gather(torch.ones(2), tag="train").wait()
    comm.update_times(wait=True)
    assert reasons == ["log", "log"]  # its end and its wait's end, where reading is allowed
    assert comm.totals().seconds > totals.seconds and comm.totals().ops == 2
    comm.close()


def test_checkpoint_staging_copies_on_a_side_stream_into_buffers_made_once(fake_cuda,
                                                                         monkeypatch):
    """A model on a GPU (CPU tensors stand in): every checkpoint's copies are queued on the
    Stager's own stream, after an event on the training stream (the work that wrote the
    tensors), with ``record_stream`` on each source; an event after them is what the
    training stream waits on before it changes them and what the writer's thread waits
    for; the page-locked buffers are allocated at the first checkpoint and reused. No
    stream or device is synchronised."""
    from loco import checkpoint

    log = fake_cuda
    made = []
    monkeypatch.setattr(checkpoint.staging, "_on_gpu", lambda t: True)
    monkeypatch.setattr(checkpoint.staging, "_host_buffer", lambda like, pin: made.append(pin) or
                        torch.empty(like.shape, dtype=like.dtype))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: log.append(
        ("record_stream", tuple(self.shape), stream.name)))
    stager = checkpoint.Stager()
    state = {"model": {"w": torch.ones(2, 3)}, "moments": [torch.arange(4.0)], "step": 1}
    first = stager.stage(state)
    written = next(e for e in log if e[0] == "record" and e[2] == "training")[1]
    ready = stager.ready
    assert ready.recorded_on == "comm"  # the side stream (the stand-in names every one so)
    assert log.index(("wait_event", "comm", written)) < log.index(("enter_stream", "comm"))
    assert ("record_stream", (2, 3), "comm") in log and ("record_stream", (4,), "comm") in log
    assert log.index(("enter_stream", "comm")) < log.index(("record", ready.name, "comm"))
    assert log[-1] == ("wait_event", "training", ready.name)  # the training stream waits
    assert made == [True, True] and torch.equal(first["model"]["w"], state["model"]["w"])
    state["model"]["w"].add_(1)
    second = stager.stage(state)
    assert made == [True, True]  # no new buffer
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()
    assert torch.equal(second["model"]["w"], state["model"]["w"]) and second["step"] == 1
    assert stager.ready is not ready and stager.ready.recorded_on == "comm"
    writer = checkpoint.Writer.__new__(checkpoint.Writer)  # its thread's wait, alone
    writer.commit_meta, writer._error = None, None
    writer._write(2, second, None, False, stager.ready)
    assert log[-1] == ("event_synchronize", stager.ready.name)


def test_speed_aware_steps_time_a_gpu_tick_on_the_device_clock(fake_cuda):
    """Speed-aware local steps on a GPU: each trained tick's forward and backward passes are
    timed by two timing events on the training stream (``DeviceSpan``), read without waiting
    while the round goes on (only the ticks the device has run) and, at the round's end,
    every one of them (an event's wait, never a stream's or the device's)."""
    from loco.training.local_steps import DeviceSpan, LocalSteps

    log = fake_cuda
    plan = LocalSteps(sync_every=4, workers=1, replica=0, rounds=[[4]])
    FakeEvent.happened = False  # the device is behind: nothing to read yet
    try:
        for _ in range(3):
            plan.trained(DeviceSpan(torch.device("cuda", 0)).stop())
        assert plan._smoothed() == 0.0 and len(plan._spans) == 3
        assert not [e for e in log if e[0] in ("event_synchronize", "elapsed_time")]
    finally:
        FakeEvent.happened = True
    assert plan._smoothed() == pytest.approx(0.25)  # each span: one event after the other
    plan.trained(DeviceSpan(torch.device("cuda", 0)).stop())
    plan._read_spans(wait=True)
    assert plan.busy == 4 * 0.25 and plan.steps == 4 and not plan._spans
    records = [e for e in log if e[0] == "record"]
    assert {e[2] for e in records} == {"training"} and len(records) == 8
    assert ("event_synchronize", records[-1][1]) in log
