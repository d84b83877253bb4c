"""Token shards (prepare / TokenShards) and the resumable sampler. Unit tests, no processes.

Run: ``.venv/bin/pytest tests/training/test_data.py`` (a few seconds).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from training import data
from training.data import (
    META,
    BatchLayout,
    DataError,
    ResumableSampler,
    TokenShards,
    prepare,
)

# ---------------------------------------------------------------------------------------------
# prepare
# ---------------------------------------------------------------------------------------------


def _sources(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"hello world\n" * 50)
    (src / "b.py").write_bytes(b"print('x')\x00\n" * 20)  # byte 0 is the separator: dropped
    return src


def test_prepare_writes_shards_and_meta(tmp_path: Path) -> None:
    out = tmp_path / "shards"
    meta = prepare(sources=[_sources(tmp_path)], out_dir=out, shard_tokens=256)
    on_disk = json.loads((out / META).read_text())
    assert on_disk == meta
    assert meta["format"] == data.FORMAT
    assert meta["tokenizer"] == "bytes"
    assert meta["vocab_size"] == 256
    assert meta["dtype"] == "uint16"
    assert meta["num_sources"] == 2
    expected = len(b"hello world\n" * 50) + 1 + len(b"print('x')\n" * 20) + 1
    assert meta["num_tokens"] == expected
    assert sum(s["num_tokens"] for s in meta["shards"]) == expected
    assert len(meta["shards"]) == -(-expected // 256)
    tokens = np.concatenate([np.fromfile(out / s["file"], dtype="<u2") for s in meta["shards"]])
    # Documents end with the separator; no other zero survives.
    assert (tokens == data.DOC_SEPARATOR).sum() == 2
    assert bytes(tokens[:12].astype(np.uint8)) == b"hello world\n"
    # Nothing but the shards and meta.json; no staging directory left next to it.
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [META, *(s["file"] for s in meta["shards"])]
    )
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_prepare_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "shards"
    src = _sources(tmp_path)
    prepare(sources=[src], out_dir=out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (src / "c.txt").write_text("more text")
    with pytest.raises(DataError, match="already holds shards"):
        prepare(sources=[src], out_dir=out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_prepare_refuses_non_empty_directory(tmp_path: Path) -> None:
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="not an empty directory"):
        prepare(sources=[_sources(tmp_path)], out_dir=out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_prepare_into_empty_directory(tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    prepare(sources=[_sources(tmp_path)], out_dir=out)
    assert (out / META).is_file()


def test_prepare_failure_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure mid-write (disk full, ^C) leaves neither the output nor a staging dir."""
    out = tmp_path / "shards"
    calls = {"n": 0}
    real_write = Path.write_bytes

    def failing_write(self: Path, payload: bytes) -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real_write(self, payload)

    src = _sources(tmp_path)
    monkeypatch.setattr(Path, "write_bytes", failing_write)
    with pytest.raises(OSError, match="No space left"):
        prepare(sources=[src], out_dir=out, shard_tokens=128)
    assert calls["n"] == 2
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_prepare_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        prepare(sources=[tmp_path / "nope"], out_dir=tmp_path / "out")
    with pytest.raises(DataError, match="no input files"):
        prepare(sources=[], out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_stdlib_sources_are_capped_and_sorted() -> None:
    files = data.stdlib_sources(max_bytes=200_000)
    assert files, "the standard library should be found"
    assert files == sorted(files)
    assert sum(f.stat().st_size for f in files) <= 200_000
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)


# ---------------------------------------------------------------------------------------------
# TokenShards
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "t.txt").write_bytes(bytes(range(1, 251)) * 4)  # 1000 bytes + separator
    out = tmp_path / "shards"
    prepare(sources=[src], out_dir=out, shard_tokens=300)  # shards of 300,300,300,101
    return out


def test_token_shards_samples(shards: Path) -> None:
    ts = TokenShards(path=shards, seq_len=10, vocab_size=256)
    # (300-1)//10 = 29 per full shard, (101-1)//10 = 10 in the last.
    assert ts.num_samples == 29 * 3 + 10
    all_tokens = np.concatenate(
        [np.fromfile(p, dtype="<u2") for p in sorted(shards.glob("shard_*.bin"))]
    ).astype(np.int64)
    for index in (0, 1, 28, 29, 57, 58, ts.num_samples - 1):
        shard, within = divmod(index, 29) if index < 87 else (3, index - 87)
        start = shard * 300 + within * 10
        sample = ts.sample(index)
        assert sample.dtype == torch.int64 and sample.shape == (11,)
        assert sample.tolist() == all_tokens[start : start + 11].tolist(), index
    assert ts.batch([0, 5]).shape == (2, 11)


def test_truncated_shard_names_data_path(shards: Path) -> None:
    shard = shards / "shard_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"^data\.path: .*shard_00001\.bin.*truncated"):
        TokenShards(path=shards, seq_len=10, vocab_size=256)


def test_missing_shard_and_missing_meta(shards: Path, tmp_path: Path) -> None:
    (shards / "shard_00002.bin").unlink()
    with pytest.raises(DataError, match=r"^data\.path: .*missing"):
        TokenShards(path=shards, seq_len=10, vocab_size=256)
    with pytest.raises(DataError, match=r"^data\.path: no meta\.json .*prepare"):
        TokenShards(path=tmp_path / "nowhere", seq_len=10, vocab_size=256)


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (lambda m: {**m, "format": "training-tokens/0"}, r"^data\.path: .*format"),
        (lambda m: [m], r"^data\.path: .*format"),
        (lambda m: {**m, "vocab_size": 512}, r"^model\.vocab_size: 256 .*512"),
    ],
)
def test_meta_checks(shards: Path, edit, pattern: str) -> None:
    meta_path = shards / META
    meta_path.write_text(json.dumps(edit(json.loads(meta_path.read_text()))))
    with pytest.raises(DataError, match=pattern):
        TokenShards(path=shards, seq_len=10, vocab_size=256)


def test_corrupt_meta_is_a_data_error(shards: Path) -> None:
    meta_path = shards / META
    meta_path.write_text(meta_path.read_text()[:40])
    with pytest.raises(DataError, match=r"^data\.path: .*not valid JSON"):
        TokenShards(path=shards, seq_len=10, vocab_size=256)


def test_seq_len_longer_than_every_shard(shards: Path) -> None:
    with pytest.raises(DataError, match=r"^data\.seq_len"):
        TokenShards(path=shards, seq_len=400, vocab_size=256)


# ---------------------------------------------------------------------------------------------
# ResumableSampler
# ---------------------------------------------------------------------------------------------

GLOBAL_BATCH = 12  # divisible by world sizes 1, 2, 3, 4 with micro * accum = 12 / world


def _sampler(
    world: int,
    rank: int,
    *,
    num_samples: int = 100,
    seed: int = 7,
    shuffle: bool = True,
    micro: int | None = None,
    accum: int = 1,
) -> ResumableSampler:
    micro = micro if micro is not None else GLOBAL_BATCH // (world * accum)
    layout = BatchLayout(
        world_size=world, rank=rank, micro_batch_size=micro, grad_accum_steps=accum
    )
    return ResumableSampler(num_samples=num_samples, layout=layout, seed=seed, shuffle=shuffle)


def _global_steps(samplers: list[ResumableSampler], steps: int) -> list[list[int]]:
    """Per step, the samples of all ranks in layout order (micro-batch major, then rank)."""
    out = []
    for _ in range(steps):
        per_rank = [s.next_step() for s in samplers]
        accum = len(per_rank[0])
        out.append([i for m in range(accum) for r in per_rank for i in r[m]])
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sampler_resume_exact(world: int) -> None:
    """Resuming from a saved position gives exactly the rest: no repeats, no gaps."""
    steps, cut = 8, 3  # 8 steps * 12 = 96 <= epoch of 96 (100 rounded down to 12s)
    straight = _global_steps([_sampler(world, r) for r in range(world)], steps)
    flat = [i for step in straight for i in step]
    assert len(flat) == len(set(flat)) == steps * GLOBAL_BATCH  # one epoch: all distinct
    assert all(0 <= i < 100 for i in flat)

    first = [_sampler(world, r) for r in range(world)]
    head = _global_steps(first, cut)
    saved = [s.state_dict() for s in first]
    assert all(st == {"consumed_samples": cut * GLOBAL_BATCH, "seed": 7} for st in saved)
    resumed = [_sampler(world, r) for r in range(world)]
    for sampler, state in zip(resumed, saved, strict=True):
        sampler.load_state_dict(state)
    tail = _global_steps(resumed, steps - cut)
    assert head + tail == straight


@pytest.mark.parametrize(("world", "accum"), [(1, 1), (1, 3), (2, 2), (3, 1), (4, 3), (2, 6)])
def test_sampler_same_global_sets_on_any_world(world: int, accum: int) -> None:
    """Same global batch split differently: the same global samples at every step."""
    reference = _global_steps([_sampler(1, 0)], 5)
    other = _global_steps([_sampler(world, r, accum=accum) for r in range(world)], 5)
    assert other == reference  # same order, even, by the layout


@pytest.mark.parametrize(("before", "after"), [(2, 3), (4, 1), (1, 4), (3, 2)])
def test_sampler_resume_on_another_world_size(before: int, after: int) -> None:
    straight = _global_steps([_sampler(1, 0)], 6)
    first = [_sampler(before, r) for r in range(before)]
    head = _global_steps(first, 2)
    state = first[0].state_dict()
    resumed = [_sampler(after, r) for r in range(after)]
    for sampler in resumed:
        sampler.load_state_dict(state)
    assert head + _global_steps(resumed, 4) == straight


def test_sampler_ranks_are_disjoint() -> None:
    per_rank = [_sampler(4, r, micro=1, accum=3).next_step() for r in range(4)]
    assert all(len(mb) == 3 and all(len(b) == 1 for b in mb) for mb in per_rank)
    flat = [i for mb in per_rank for b in mb for i in b]
    assert len(set(flat)) == 12


def test_sampler_epoch_wraps_with_a_new_order() -> None:
    # 30 samples, global batch 12: epochs of 24 samples (2 steps); 6 left out each epoch.
    sampler = _sampler(1, 0, num_samples=30)
    assert sampler.epoch_len == 24
    steps = [sampler.next_step()[0] for _ in range(6)]
    epochs = [steps[0] + steps[1], steps[2] + steps[3], steps[4] + steps[5]]
    for epoch in epochs:
        assert len(set(epoch)) == 24 and all(0 <= i < 30 for i in epoch)
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch
    # Resuming in the middle of a later epoch continues the same order.
    resumed = _sampler(1, 0, num_samples=30)
    resumed.load_state_dict({"consumed_samples": 36, "seed": 7})
    assert resumed.next_step()[0] == steps[3]
    assert sampler.state_dict()["consumed_samples"] == 72


def test_sampler_without_shuffle_is_sequential() -> None:
    sampler = _sampler(2, 1, shuffle=False, num_samples=24)
    assert sampler.next_step() == [[6, 7, 8, 9, 10, 11]]
    assert sampler.next_step() == [[18, 19, 20, 21, 22, 23]]
    assert sampler.next_step() == [[6, 7, 8, 9, 10, 11]]  # wrapped


def test_sampler_seed_changes_order_and_mismatch_fails() -> None:
    assert _sampler(1, 0, seed=1).next_step() != _sampler(1, 0, seed=2).next_step()
    with pytest.raises(DataError, match=r"^train\.seed: .*seed 8.*--train\.seed=8"):
        _sampler(1, 0).load_state_dict({"consumed_samples": 12, "seed": 8})


def test_sampler_rejects_a_different_global_batch_position() -> None:
    with pytest.raises(DataError, match=r"^train\.micro_batch_size: .*global batch"):
        _sampler(2, 0).load_state_dict({"consumed_samples": 18, "seed": 7})


def test_sampler_global_batch_larger_than_data() -> None:
    with pytest.raises(DataError, match=r"^train\.micro_batch_size: global batch 12 exceeds"):
        _sampler(2, 0, num_samples=11)
