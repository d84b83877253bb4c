"""Shared fixtures for the whole test suite.

Run everything with ``.venv/bin/pytest`` (or ``make test``); only the trainer tests with
``.venv/bin/pytest tests/training``. Tests marked ``gpu`` are skipped when CUDA is absent.
Helpers (starting jobs, reading metrics and checkpoints) are in ``tests/support.py``.

- ``corpus``: a tiny, learnable byte-token shard directory built once per session with
  ``training.data.prepare`` (repeating word cycles: a small model learns it in a few steps).
- ``torchrun``: the :func:`support.run_torchrun` helper as a fixture.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import pytest
from support import (
    REQUIRE_ALL_ENV,
    forget_the_calling_make,
    node_reason,
    run_torchrun,
    skip_or_fail,
    write_learnable_text,
)

_LEFT_OUT = pytest.StashKey[str]()
_CPU_USE = pytest.StashKey[dict[str, tuple[float, float]]]()


def pytest_configure(config: pytest.Config) -> None:
    forget_the_calling_make(os.environ)
    config.addinivalue_line(
        "markers",
        "requires(reason): what the test needs from the machine is missing when reason is set "
        "(support.requires_tool / requires_root): skipped, or failed under TESTS_REQUIRE_ALL=1",
    )
    # pytest-xdist's own marker, named here too so that a run without xdist accepts it.
    config.addinivalue_line(
        "markers", "xdist_group(name): tests of one group run on one worker, one after the other"
    )


XDIST_GROUPS: dict[str, tuple[str, ...]] = {
    # They build the repo's data/stdlib when a fresh clone lacks it (`make train`, and
    # bench.common's ensure_corpus before every benchmark run: two would write it at once),
    # and `make train`'s exporter binds the default metrics port (training.observe.catalog).
    "repo-corpus": (
        "training/launch/test_make_train.py",
        "training/launch/test_local_run_ends.py",
        "bench/test_bench_smoke.py",
        "bench/test_bench_peer.py",
    ),
    # One synth per configuration for the session (tests/infra/conftest.py): on one worker.
    "infra": ("infra/",),
    # Modules whose tests assert one module fixture's runs: on one worker, the runs happen once.
    "parallel-runs": ("training/test_parallel.py",),
    "resilience-reference": ("training/resilience/test_resilience.py",),
    "timelines-runs": ("training/checkpoint/test_timelines.py",),
    "peer-runs": ("training/checkpoint/test_peer.py",),
    "replica-runs": ("training/replica/test_replica_fault.py",),
    "setup-wheels": ("test_setup_install.py",),
}
"""Tests that must run on one worker, one after the other, by group (path prefixes under
tests/): `make test` runs tests side by side on pytest-xdist workers (``--dist loadgroup``).
Everything else a test takes is its own per worker: ports from ``free_port``, tmp_path run
dirs, and the pod emulation's bridge, namespaces, /dev/shm and cgroup names (the worker's pid,
podsim/cluster.py RUN). tests/pods is not grouped: its module reference run happens once per
worker (twice in all), cheaper than its ~20 pod runs in a row on one worker."""


SLOW: tuple[str, ...] = (
    # The CDK CLI, make and the AWS CLI against the emulated CloudFormation, several times a
    # test: 5 s to 4 min each.
    "infra/test_day_two.py",
    # Each over ~40 s on 2 cores with a second worker beside it: torch.compile, whole checks
    # and CLIs in subprocesses, a real Prometheus, cdk-nag over the stack.
    "training/test_parallel.py::test_compiled_checkpointed_block_keeps_the_math",
    "training/test_gpu_check.py::test_in_process_checks_run_with_cuda_faked_at_the_boundary",
    "observability/test_prometheus_scrape.py",
    "infra/test_infra_validation.py::test_cdk_nag_and_builtin_validation_pass",
    "infra/test_infra_config.py::test_app_exits_non_zero_with_the_message",
    "infra/test_image_context.py::test_store_context_holds_exactly_what_its_dockerfile_copies",
    "planner/test_tiers.py::test_answer_shows_tiers_overlays_and_the_emulation",
    "training/test_startup_check.py::test_a_stuck_fsx_client_exits_node_unfit_naming_the_node",
    "training/test_startup_check.py::test_fsx_mount_without_its_type_is_a_job_setting_error",
    "training/launch/test_cli.py::test_launcher_rejects_nproc_0",
    "manifests/test_preflight.py::test_submit_applies_the_job_follows_rank0_and_passes",
)
"""Tests (node id prefixes under tests/) marked ``slow`` here, beside those marked in their
own files: ``make test-fast`` (``-m "not slow and not distributed"``) leaves them out."""


INFRA = Path(__file__).with_name("infra")
"""Imports aws-cdk-lib, whose jsii runtime starts Node.js at import: without Node.js no test
there can even be collected, so the directory is left out, with the reason in the summary."""


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path != INFRA or os.environ.get(REQUIRE_ALL_ENV) == "1":
        return None
    reason = node_reason()
    if reason is None:
        return None
    config.stash[_LEFT_OUT] = f"tests/infra not collected: {reason}"
    return True


def _cpu_seconds() -> float:
    """CPU of this process and of every descendant that ended and was waited for (a rank
    torchrun waited for counts through torchrun): what a test's processes used."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Each test's wall and CPU seconds (a module fixture's runs count in its first test), for
    the summary: a test that keeps the cores busy is made shorter by doing less; one that waits
    on a timer, by a shorter timer or a neighbour beside it (issue #38's suite time)."""
    wall, cpu = time.monotonic(), _cpu_seconds()
    yield
    used = (time.monotonic() - wall, _cpu_seconds() - cpu)
    item.config.stash.setdefault(_CPU_USE, {})[item.nodeid] = used


def _write_cpu_use(terminalreporter, uses: dict[str, tuple[float, float]]) -> None:
    wall = sum(w for w, _ in uses.values())
    cpu = sum(c for _, c in uses.values())
    cores = os.cpu_count() or 1
    terminalreporter.write_sep("=", "CPU use (tests/conftest.py)")
    terminalreporter.write_line(
        f"{len(uses)} tests: {wall:.0f} s wall, {cpu:.0f} s CPU, "
        f"{cpu / max(wall, 1e-9):.2f} of {cores} cores busy on average"
    )
    slowest = sorted(uses.items(), key=lambda kv: kv[1][0], reverse=True)[:40]
    for nodeid, (w, c) in slowest:
        terminalreporter.write_line(
            f"{w:8.1f}s wall {c:8.1f}s CPU {c / max(w, 1e-9):5.2f} cores  {nodeid}"
        )


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if _LEFT_OUT in config.stash:
        terminalreporter.write_line(config.stash[_LEFT_OUT], yellow=True)
    uses = config.stash.get(_CPU_USE, {})
    if len(uses) > 1:  # under xdist the workers keep their own: nothing here
        _write_cpu_use(terminalreporter, uses)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A missing tool or privilege skips the test with its one-line reason; in CI
    (``TESTS_REQUIRE_ALL=1``, .ci/run) it fails it: CI runs everything."""
    for mark in item.iter_markers("requires"):
        reason = mark.kwargs.get("reason")
        if reason is None:
            continue
        skip_or_fail(reason)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        if not item.path.is_relative_to(tests):
            continue  # a test this conftest is lent to (tests/test_machine_requirements.py)
        where = item.path.relative_to(tests).as_posix()
        if f"{where}::{item.name}".startswith(SLOW):
            item.add_marker(pytest.mark.slow)
        for group, prefixes in XDIST_GROUPS.items():
            if where.startswith(prefixes):
                item.add_marker(pytest.mark.xdist_group(group))
                break
    if not any("gpu" in item.keywords for item in items):
        return  # torch is imported only when a gpu test was collected
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shard directory (``meta.json`` + one shard, ~70k byte tokens) of learnable text."""
    from training.data import prepare

    root = tmp_path_factory.mktemp("corpus")
    source = root / "src"
    source.mkdir()
    write_learnable_text(source / "words.txt")
    out = root / "shards"
    prepare(sources=[source], out_dir=out)
    return out


@pytest.fixture(scope="session")
def torchrun():
    """The :func:`run_torchrun` helper as a fixture."""
    return run_torchrun


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group (in-memory store) for the test, destroyed after it."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
