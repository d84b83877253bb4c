"""Every background thread that may touch CUDA is bound to the rank's GPU before its first CUDA
call, and the CUDA registration of snapshot slots runs off the training thread.

The device boundary: this machine has no GPU, so ``torch.cuda.set_device`` and
``cudaHostRegister``/``cudaHostUnregister`` are replaced by recording stand-ins (a real GPU is
the only alternative); everything above them (the threads, their order, the waits, the files,
the fallback) is the real code. ``make gpu-check``'s ``pod_memory_snapshot`` and
``peer_exchange`` run the same paths on CUDA (tests/gpu_check.py).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from training.checkpoint import device_threads
from training.checkpoint import snapshot_files as sf
from training.checkpoint.pod_memory import PodMemorySnapshots

REPO_ROOT = Path(__file__).resolve().parents[3]

REVIEWED_THREADS = {
    "training/startup_check.py": "its thread probes the FSx mount (file I/O only)",
    "training/resilience/inprocess.py": "its pinger only reports progress to NVRx's monitor",
}
"""Modules that start a ``threading.Thread`` directly and also use CUDA somewhere, each checked
by hand: the thread itself makes no CUDA call. Any other thread in such a module goes through
``device_threads.start``."""


class Recorder:
    """What each thread did, in order: (thread name, call, argument)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.lock = threading.Lock()

    def __call__(self, call: str, argument: Any = None) -> None:
        with self.lock:
            self.calls.append((threading.current_thread().name, call, argument))

    def in_thread(self, name: str) -> list[tuple[str, Any]]:
        return [(call, arg) for thread, call, arg in self.calls if thread == name]


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    record = Recorder()
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: record("set_device", device))
    return record


def test_every_module_that_starts_a_thread_and_uses_cuda_binds_the_thread_or_was_reviewed():
    """The family of the publish thread's stray context: a thread started with
    ``threading.Thread`` in a module that uses CUDA must be one reviewed as CUDA-free (listed
    above, with why); the others use ``device_threads.start``."""
    found = {}
    for path in sorted((REPO_ROOT / "training").rglob("*.py")):
        relative = str(path.relative_to(REPO_ROOT))
        if relative == "training/checkpoint/device_threads.py":
            continue
        text = path.read_text()
        starts_thread = re.search(r"threading\.Thread\(|ThreadPoolExecutor\(", text)
        uses_cuda = re.search(r"torch\.cuda\.|cudart\(|cuda\.Event|cuda\.Stream", text)
        if starts_thread and uses_cuda:
            found[relative] = True
    assert set(found) == set(REVIEWED_THREADS), (
        "a module starts a thread and uses CUDA: bind the thread with device_threads.start, or "
        f"review it and list it in REVIEWED_THREADS: {sorted(set(found) ^ set(REVIEWED_THREADS))}"
    )
    for module in ("pod_memory.py", "peer.py", "snapshot_files.py"):
        text = (REPO_ROOT / "training/checkpoint" / module).read_text()
        assert "threading.Thread(" not in text and "device_threads.start(" in text, module


def test_a_thread_started_for_a_device_sets_it_before_running_its_target(recorder: Recorder):
    thread = device_threads.start(lambda: recorder("target"), name="bound", device=5)
    thread.join()
    assert recorder.in_thread("bound") == [("set_device", 5), ("target", None)]
    unbound = device_threads.start(lambda: recorder("target"), name="unbound", device=None)
    unbound.join()
    assert recorder.in_thread("unbound") == [("target", None)]
    assert device_threads.device_index(torch.device("cpu")) is None
    assert device_threads.device_index(torch.device("cuda", 3)) == 3


def test_the_publish_thread_binds_the_rank_gpu_before_it_synchronizes_the_copy_event(
    tmp_path: Path, recorder: Recorder
) -> None:
    """Local rank 3's publish thread: set_device(3), then the event's synchronize (on a new
    thread without it, that synchronize binds GPU 0's context), then the meta."""

    class CopyEvent:  # the CUDA event recorded after the device-to-host copies
        def synchronize(self) -> None:
            recorder("synchronize")

    snapshots = PodMemorySnapshots(root=tmp_path, owner="o", rank=3, world_size=8)
    state = {"w": torch.arange(16, dtype=torch.float32), "step": 4}
    meta = sf.meta_for(state, owner="o", rank=3, world_size=8, step=4)
    target = sf.SlotFile(sf.slot_dir(tmp_path, kind="own", rank=3, slot=0), nbytes=meta.nbytes)
    sf.pack(state, target.data, meta)
    snapshots._start_publish(target, meta, ready=CopyEvent(), device=3)
    snapshots.wait()
    name = "pod-memory-publish-4"
    assert recorder.in_thread(name) == [("set_device", 3), ("synchronize", None)]
    assert [m.step for _, m in sf.list_snapshots(tmp_path, kind="own", rank=3)] == [4]
    target.close()


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch, recorder: Recorder):
    """cudaHostRegister that blocks until released (as a registration of GBs takes seconds)."""
    release = threading.Event()
    started = threading.Event()
    outcome: dict[str, Any] = {"fail": False}

    def register(tensor: torch.Tensor) -> None:
        recorder("register", tensor.numel())
        started.set()
        assert release.wait(30)
        if outcome["fail"]:
            raise RuntimeError("cudaHostRegister failed (1) for the mapping")

    monkeypatch.setattr(sf, "_cuda_register", register)
    monkeypatch.setattr(sf, "_cuda_unregister", lambda tensor: recorder("unregister"))
    return release, started, outcome


def test_registration_runs_on_a_bound_thread_and_the_first_use_waits_for_it(
    tmp_path: Path, recorder: Recorder, registry
) -> None:
    release, started, _ = registry
    slot = sf.SlotFile(tmp_path / "slot-0", nbytes=1000, pin=True, device=2)
    # The constructor returned while the registration is still blocked: the caller (the
    # training thread) did not pay for it.
    assert started.wait(10) and not slot.pinned
    main = threading.current_thread().name
    assert all(call != "register" for call, _ in recorder.in_thread(main))
    release.set()
    assert slot.wait_pinned() is True
    (registering,) = {t for t, call, _ in recorder.calls if call == "register"}
    assert registering != main
    assert recorder.in_thread(registering) == [("set_device", 2), ("register", 1024)]
    slot.close()
    assert recorder.in_thread(main)[-1] == ("unregister", None)


def test_a_failed_registration_warns_and_the_slot_works_unpinned(
    tmp_path: Path, recorder: Recorder, registry
) -> None:
    release, _, outcome = registry
    outcome["fail"] = True
    release.set()
    slot = sf.SlotFile(tmp_path / "slot-0", nbytes=100, pin=True, device=0)
    with pytest.warns(UserWarning, match="cudaHostRegister failed"):
        assert slot.wait_pinned() is False
    slot.data.fill_(7)
    slot.close()
    assert not any(call == "unregister" for _, call, _ in recorder.calls)


def test_the_first_snapshot_waits_for_the_registration_prepare_started(
    tmp_path: Path, recorder: Recorder, registry
) -> None:
    """``prepare`` (after the first step) maps both slots and starts their registration in the
    background without un-publishing the snapshot a restart may still need; the first ``take``
    into a slot whose registration is still running waits for it before any copy."""
    release, started, _ = registry
    state = {"w": torch.arange(256, dtype=torch.float32), "step": 1}
    earlier = PodMemorySnapshots(root=tmp_path, owner="o", rank=0, world_size=1)
    earlier.take(state, step=1)
    earlier.close(remove=False)

    snapshots = PodMemorySnapshots(root=tmp_path, owner="o", rank=0, world_size=1)
    nbytes = sf.meta_for(state, owner="o", rank=0, world_size=1, step=0).nbytes
    for slot in range(sf.SLOTS):  # what prepare does for a state on GPU 1
        snapshots._slot_file(slot, nbytes=nbytes, device=1, keep_meta=True)
    assert started.wait(10)
    assert [m.step for _, m in snapshots.held()] == [1]  # still offered

    taking = threading.Thread(target=snapshots.take, args=(state,), kwargs={"step": 2})
    taking.start()
    taking.join(timeout=0.5)
    assert taking.is_alive(), "take copied into a slot whose registration is still running"
    assert [m.step for _, m in sf.list_snapshots(tmp_path, kind="own", rank=0)] == [1]
    release.set()
    taking.join(timeout=30)
    snapshots.wait()
    assert [m.step for _, m in snapshots.held()] == [2, 1]
    snapshots.close(remove=True)


def test_prepare_maps_both_slots_and_keeps_a_complete_snapshot_offered(tmp_path: Path) -> None:
    state = {"w": torch.arange(64, dtype=torch.float32), "step": 1}
    earlier = PodMemorySnapshots(root=tmp_path, owner="o", rank=0, world_size=1)
    earlier.take(state, step=1)
    earlier.close(remove=False)
    snapshots = PodMemorySnapshots(root=tmp_path, owner="o", rank=0, world_size=1)
    snapshots.prepare(state)
    assert sorted(snapshots._files) == list(range(sf.SLOTS))
    assert [m.step for _, m in snapshots.held()] == [1]
    state["w"].add_(1)
    snapshots.take(state, step=2)
    snapshots.wait()
    assert [m.step for _, m in snapshots.held()] == [2, 1]
    snapshots.close(remove=True)
