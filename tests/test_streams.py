"""The CUDA hand-over between the training stream and a Comm's stream, checked on CPU
against a recording stand-in for ``torch.cuda``: what is recorded and waited on, and where.
It checks the protocol PyTorch documents (events and ``record_stream``, never a device-wide
synchronise); it cannot show NCCL's behaviour, which needs a GPU (see docs/gpu.md)."""

import contextlib

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
    count = 0

    def __init__(self, log):
        FakeEvent.count += 1
        self.name, self.log, self.recorded_on = f"event{FakeEvent.count}", log, None

    def record(self, stream):
        self.recorded_on = stream.name
        self.log.append(("record", self.name, stream.name))

    def query(self):
        self.log.append(("query", self.name))
        return True

    def synchronize(self):
        self.log.append(("event_synchronize", self.name))


class FakeTensor:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def record_stream(self, stream):
        self.log.append(("record_stream", self.name, stream.name))


@pytest.fixture
def fake_cuda(monkeypatch):
    log, current = [], {}
    training = FakeStream("training", log)
    current["stream"] = training

    @contextlib.contextmanager
    def use_stream(stream):
        before = current["stream"]
        current["stream"] = stream
        log.append(("enter_stream", stream.name))
        try:
            yield
        finally:
            current["stream"] = before

    @contextlib.contextmanager
    def use_device(device):
        log.append(("enter_device", str(device)))
        yield

    def forbidden(*a, **k):
        raise AssertionError("torch.cuda.synchronize (device-wide) was called")

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: FakeStream("comm", log))
    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["stream"])
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
