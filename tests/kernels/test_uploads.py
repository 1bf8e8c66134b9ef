"""hicache_kernels.uploads: host indices go to the GPU through a ring of pinned buffers (one queued copy,
no stream wait). On CPU the ring runs over pageable buffers with recording events (what a CPU can
check: the bytes, the packing, the order of a buffer's reuse after its previous copy, the fallbacks);
the ``gpu`` test runs it for real beside a busy stream."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from hicache_kernels import launch, uploads
from hicache_kernels.backends.base import device_indices


class Log:
    """Events that record what happens to them, in one shared order."""

    def __init__(self) -> None:
        self.order: list[tuple[str, int]] = []
        self.made = 0

    def new_event(self):
        log = self
        log.made += 1
        n = log.made

        class Event:
            def record(self, stream=None):
                log.order.append(("record", n))

            def synchronize(self):
                log.order.append(("synchronize", n))

        return Event()


def ring(log: Log | None = None, **kw) -> uploads.UploadRing:
    log = log or Log()
    return uploads.UploadRing("cpu", pin=False, new_event=log.new_event, on_stream=lambda s: contextlib.nullcontext(),
                              **kw)  # fmt: skip


def rand(n: int, dtype=torch.int64, seed: int = 0) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, (n,), generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_uploads_copy_the_bytes_with_their_dtypes_and_shapes():
    r = ring(slot_bytes=256)
    a, b, c = rand(5, seed=1), rand(3, seed=2), rand(7, torch.int32, seed=3)
    want = [a.clone(), b.clone(), c.clone()]
    got = r.upload((a, b, c), None)
    a.fill_(0), b.fill_(0), c.fill_(0)  # the host tensors may change once the call returns
    assert [(g.dtype, tuple(g.shape)) for g in got] == [(w.dtype, tuple(w.shape)) for w in want]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert all(g.data_ptr() % 16 == 0 for g in got) and (r.uploads, r.plain) == (1, 0)


def test_a_buffer_is_written_again_only_after_its_previous_copy_completed():
    log = Log()
    r = ring(log, slots=2, slot_bytes=64)
    outs = [r.upload((rand(4, seed=i),), None) for i in range(5)]
    # Uploads 1 and 2 use fresh buffers; upload 3 reuses buffer 1 once event 1 completed, and so on.
    assert log.order == [("record", 1), ("record", 2), ("synchronize", 1), ("record", 3), ("synchronize", 2),
                         ("record", 4), ("synchronize", 3), ("record", 5)]  # fmt: skip
    assert all(torch.equal(o[0], rand(4, seed=i)) for i, o in enumerate(outs))  # reuse overwrote no result


@pytest.mark.parametrize("why", ["too large", "capturing"])
def test_uploads_that_cannot_use_a_buffer_go_the_plain_way(why):
    log = Log()
    r = ring(log, slot_bytes=32)
    t = rand(5 if why == "too large" else 2, seed=4)  # 40 bytes > 32
    (got,) = r.upload((t,), None, capturing=why == "capturing")
    assert torch.equal(got, t) and (r.uploads, r.plain) == (0, 1) and log.order == []


@pytest.mark.parametrize(
    "kw, match",
    [(dict(slots=0), "slots: expected a positive int"), (dict(slots=True), "slots"),
     (dict(slot_bytes=10), "slot_bytes: expected a positive multiple of 16"), (dict(slot_bytes=0), "slot_bytes")],
)  # fmt: skip
def test_ring_arguments_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        ring(**kw)


def test_threads_uploading_at_once_each_get_their_own_bytes():
    r = ring(slots=3, slot_bytes=1024)
    errors = []

    def worker(k: int) -> None:
        try:
            for i in range(200):
                t, u = rand(1 + (i % 9), seed=k * 1000 + i), rand(3, seed=k * 7 + i)
                a, b = r.upload((t, u), None)
                assert torch.equal(a, t) and torch.equal(b, u)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and r.uploads == 800


def test_device_indices_send_host_indices_through_the_devices_ring(monkeypatch):
    seen = []

    class FakeRing:
        def upload(self, tensors, stream, capturing=False):
            seen.append((tuple(t.tolist() for t in tensors), stream, capturing))
            return [t + 100 for t in tensors]

    monkeypatch.setattr(uploads, "upload_ring", lambda device: seen.append(device) or FakeRing())
    monkeypatch.setattr(launch, "capturing", lambda: False)  # (asks CUDA)

    class Plan:
        src_indices, dst_indices = torch.tensor([1, 2]), torch.tensor([3, 4])

    s, d = device_indices(Plan(), torch.device("cuda", 1), "the stream")
    assert seen == [torch.device("cuda", 1), (([1, 2], [3, 4]), "the stream", False)]
    assert s.tolist() == [101, 102] and d.tolist() == [103, 104]


@pytest.mark.gpu
def test_gpu_uploads_beside_a_busy_stream_are_right_and_do_not_wait_for_it():
    stream = torch.cuda.Stream()
    r = uploads.UploadRing(torch.device("cuda", torch.cuda.current_device()), slots=2, slot_bytes=4096)
    big = torch.randn(4096, 4096, device="cuda")
    with torch.cuda.stream(stream):
        for _ in range(20):
            big = big @ big / 4096  # keeps the stream busy for a while
    t = rand(300, seed=5)
    want = t.clone()
    (got,) = r.upload((t,), stream)
    t.fill_(0)  # overwritten at once: the upload already took its bytes
    stream.synchronize()
    assert torch.equal(got.cpu(), want) and r.uploads == 1
