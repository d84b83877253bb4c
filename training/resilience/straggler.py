"""Straggler detection and the eviction policy: a step hook (``StragglerHooks``).

Every ``straggler.report_every`` steps each rank's relative performance score comes from
NVRx 0.4.1's straggler module (``nvidia_resiliency_ext.straggler``): the fastest rank's median
time over this rank's median time, 1.0 for the fastest rank, 0.5 for a rank twice as slow.

- On a GPU, ``Detector`` times the CUDA kernels of the ``step`` section with CUPTI (NVRx leaves
  NCCL kernels out, so a rank's score is its own compute, not its wait for a peer).
- NVRx 0.4.1's CUPTI extension links ``libcupti.so.12`` (``ldd nvrx_cupti_module*.so``); the
  shipped image is torch 2.13 on CUDA 13 (``training/Dockerfile``), which lacks it, so
  ``Detector.initialize`` raises ImportError there. Then the step's sections
  (:data:`SECTIONS`: forward, backward, communication, optimizer) are timed with CUDA events
  (read at the report, so no step synchronizes the host) and scored one by one by NVRx's
  ``ReportGenerator``; a rank's score is its lowest over :data:`SCORED_SECTIONS` (forward and
  optimizer on a GPU), and the reports say ``source: sections:forward,optimizer``. Before,
  only the optimizer was timed there: a fused, HBM-bound AdamW with no compute and no network.
- On a CPU there are no kernels, and gloo's collectives block the host, so only the
  ``optimizer`` section is rank-local and scored (AdamW's update of the rank's own shards);
  the others are timed and reported. ``Detector.initialize`` loads NVRx's CUPTI extension
  unconditionally (``libcupti`` is missing on a CPU machine), so here the section times go
  straight to NVRx's ``ReportGenerator``, the scoring that ``Detector`` calls.

Rank 0 gets every rank's score (``gather_on_rank0``), broadcasts them with each rank's node
(``NODE_NAME``, the pod's ``spec.nodeName`` on EKS; the hostname otherwise), and writes the
``straggler_report`` event. Every rank then feeds the same numbers to the same
``EvictionPolicy``, so all ranks reach the same decision at the same step without another
collective; the loop stops them there with a final checkpoint (``training.trainer``).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ops.cordon import in_cluster, ready_spares
from training.config import StragglerConfig
from training.hooks import NodeEviction, StepHooks
from training.runlog.files import STRAGGLER_EVICTION_EVENT, STRAGGLER_REPORT_EVENT
from training.runlog.metrics import EventLog
from training.runlog.verdict import NODE_NAME_ENV

log = logging.getLogger(__name__)


STEP_SECTION = "step"
"""GPU with CUPTI: the section whose CUDA kernels NVRx times."""
SECTIONS = ("forward", "backward", "communication", "optimizer")
"""Without CUPTI (CPU; a GPU whose image cannot load NVRx's CUPTI module): the step's sections
(``training.trainer``) timed one by one, each scored by NVRx's ``ReportGenerator``."""
SCORED_SECTIONS = {"cpu": ("optimizer",), "cuda": ("forward", "optimizer")}
"""The sections whose scores make a rank's score (its lowest), per device type.

- A section with a collective inside measures the slowest peer, the same on every rank (on
  gloo every collective blocks the host; the ``communication`` section's all-reduces anywhere):
  reported, never scored. There the straggler is the rank that waits least, so its
  ``communication`` score is the highest, which the report shows beside the rest.
- CPU: ``forward`` and ``backward`` run FSDP's all-gathers and reduce-scatters synchronously;
  only ``optimizer`` is rank-local.
- GPU: CUDA events on the compute stream. FSDP2 issues a block's all-gather ahead of its
  forward on its own stream, so ``forward`` is mostly the rank's own compute (throttled SMs
  show there, and in the HBM-bound ``optimizer``); ``backward`` ends waiting for the last
  reduce-scatter, i.e. for the slowest peer. Not measured on a GPU yet (no GPU here)."""
LOCAL_SECTION = "optimizer"
"""The rank-local section on every device (kept for readers of the old name)."""

REPORT_EVENT = STRAGGLER_REPORT_EVENT
EVICTION_EVENT = STRAGGLER_EVICTION_EVENT
EVICTION_DEFERRED_EVENT = "straggler_eviction_deferred"
"""A due eviction that waits: no Ready hot spare (``ops.cordon.ready_spares``)."""
UNKNOWN_SPARES = -1
"""In a pod, the API could not count the spares (no permission, no answer): the eviction
waits as with none (an eviction that cannot be replaced costs the whole job)."""


def node_name() -> str:
    return os.environ.get(NODE_NAME_ENV) or socket.gethostname()


@dataclass(frozen=True, kw_only=True)
class RankScore:
    rank: int
    node: str
    score: float
    """Relative performance (0..1]; NaN when the rank timed nothing since the last report."""


def node_scores(scores: list[RankScore]) -> dict[str, float]:
    """Each node's score: its slowest rank's (a node is as slow as its slowest GPU)."""
    out: dict[str, float] = {}
    for s in scores:
        if math.isnan(s.score):
            continue
        out[s.node] = min(out.get(s.node, math.inf), s.score)
    return out


class EvictionPolicy:
    """Which node to evict, from one report's node scores at a time. Pure: no I/O, no clock.

    A node is slow in a report when its score is below ``threshold``; it is evicted when it has
    been slow in ``reports`` reports in a row. Relative scores compare with the fastest rank, so
    when more than half of the nodes look slow the fastest one is the odd one out (or the whole
    job slowed down): then no node is evicted. At most one node per report, the slowest."""

    def __init__(self, *, threshold: float, reports: int) -> None:
        self.threshold = threshold
        self.reports = reports
        self.streaks: dict[str, int] = {}

    def observe(self, scores: Mapping[str, float]) -> str | None:
        slow = {node for node, score in scores.items() if score < self.threshold}
        self.streaks = {node: self.streaks.get(node, 0) + 1 for node in sorted(slow)}
        if 2 * len(slow) > len(scores):
            return None
        due = [node for node, streak in self.streaks.items() if streak >= self.reports]
        if not due:
            return None
        return min(due, key=lambda node: (scores[node], node))


class _SectionTimer:
    """The step's sections (:data:`SECTIONS`) timed per entry, summarised per report as NVRx's
    ``Detector`` does (``Detector._get_section_summaries``) and scored by NVRx's
    ``ReportGenerator``, the scoring ``Detector.generate_report`` calls. With ``cuda``, CUDA
    events on the current stream (read at the next report: no step synchronizes the host);
    else the host's wall time."""

    def __init__(self, *, node: str, cuda: bool = False) -> None:
        from nvidia_resiliency_ext.straggler.reporting import ReportGenerator

        self._cuda = cuda
        self.scored = SCORED_SECTIONS["cuda" if cuda else "cpu"]
        self._reporter = ReportGenerator(
            scores_to_compute=["relative_perf_scores"], gather_on_rank0=True, node_name=node
        )
        self._elapsed_ms: dict[str, list[float]] = {name: [] for name in SECTIONS}
        self._events: list[tuple[str, Any, Any]] = []
        self.medians_ms: dict[str, float] = {}
        """This rank's median per section at the last report (the report event's figures)."""

    @contextmanager
    def timing(self, name: str) -> Iterator[None]:
        if name not in self._elapsed_ms:
            yield
            return
        if self._cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
            return
        started = time.perf_counter_ns()
        yield
        self._elapsed_ms[name].append((time.perf_counter_ns() - started) * 1e-6)

    def report(self) -> tuple[dict[int, float], dict[int, str], dict[str, dict[int, float]]]:
        """Collective on every rank; rank 0 gets rank -> score (the lowest of the scored
        sections), rank -> node and section -> rank -> score; the others empty dicts."""
        from nvidia_resiliency_ext.straggler.statistics import Statistic

        for name, start, end in self._events:
            end.synchronize()
            self._elapsed_ms[name].append(start.elapsed_time(end))
        self._events.clear()
        summaries: dict[str, Any] = {}
        self.medians_ms = {}
        for name, samples in self._elapsed_ms.items():
            if not samples:
                continue
            t = torch.tensor(samples, dtype=torch.float64)
            summaries[name] = {
                Statistic.MIN: t.min().item(),
                Statistic.MAX: t.max().item(),
                Statistic.MED: t.median().item(),
                Statistic.AVG: t.mean().item(),
                Statistic.STD: t.std().item() if len(t) > 1 else float("nan"),
                Statistic.NUM: len(t),
            }
            self.medians_ms[name] = summaries[name][Statistic.MED]
            samples.clear()
        report = self._reporter.generate_report(summaries, {})
        if report is None:
            return {}, {}, {}
        sections = {name: dict(v) for name, v in report.section_relative_perf_scores.items()}
        by_rank: dict[int, float] = {}
        for name in self.scored:
            for rank, score in sections.get(name, {}).items():
                by_rank[rank] = min(by_rank.get(rank, math.inf), score)
        return by_rank, dict(report.rank_to_node), sections

    def close(self) -> None:
        pass


class _GpuKernels:
    """NVRx's ``Detector``: CUPTI kernel timings of the ``step`` section (GPU only)."""

    def __init__(self, *, node: str) -> None:
        from nvidia_resiliency_ext.straggler import Detector

        self._detector = Detector
        if Detector.initialized:  # an in-process restart's earlier attempt left it set up
            Detector.shutdown()
        Detector.initialize(
            scores_to_compute=["relative_perf_scores"],
            gather_on_rank0=True,
            profiling_interval=1,
            report_time_interval=math.inf,  # reports come every N steps, from the hook
            node_name=node,
        )

    def timing(self, name: str) -> Any:
        if name != STEP_SECTION:
            return nullcontext()
        return self._detector.detection_section(STEP_SECTION, profile_cuda=True)

    def report(self) -> tuple[dict[int, float], dict[int, str], dict[str, dict[int, float]]]:
        report = self._detector.generate_report()
        if report is None:
            return {}, {}, {}
        return dict(report.gpu_relative_perf_scores), dict(report.rank_to_node), {}

    def close(self) -> None:
        if self._detector.initialized:
            self._detector.shutdown()


def _timer_for(device: torch.device, *, node: str) -> _SectionTimer | _GpuKernels:
    if device.type != "cuda":
        return _SectionTimer(node=node)
    try:
        return _GpuKernels(node=node)
    except ImportError as err:  # NVRx's CUPTI extension cannot load (see the module docstring)
        log.warning(
            "straggler: CUPTI timings unavailable (%s); timing the step's sections with CUDA "
            "events",
            err,
        )
        return _SectionTimer(node=node, cuda=True)


class StragglerHooks(StepHooks):
    """Times steps, reports scores every ``report_every`` steps, applies the policy."""

    def __init__(
        self,
        *,
        config: StragglerConfig,
        rank: int,
        device: torch.device,
        events: EventLog,
        node: str | None = None,
        spares: Callable[[], int | None] | str | None = "cluster",
    ) -> None:
        """``spares``: counts the Ready hot spares before an eviction (rank 0 calls it); None
        when nothing can replace a node's pod anyway (a local run: the eviction ends the
        run as before); ``"cluster"``: the Kubernetes API in a pod, None elsewhere."""
        if spares == "cluster":
            spares = ready_spares if in_cluster() else None
        self._spares = spares
        self.config = config
        self.rank = rank
        self.node = node or node_name()
        self.events = events
        self._timer = _timer_for(device, node=self.node)
        self.source = (
            "gpu_kernels"
            if isinstance(self._timer, _GpuKernels)
            else "sections:" + ",".join(self._timer.scored)
        )
        self.policy = EvictionPolicy(threshold=config.threshold, reports=config.reports)
        self._eviction: NodeEviction | None = None

    def timing(self, name: str) -> Any:
        return self._timer.timing(name)

    def after_step(self, step: int) -> None:
        if step % self.config.report_every != 0 or self._eviction is not None:
            return
        by_rank, nodes, sections = self._timer.report()
        spares = None
        if self.rank == 0:
            spares = self._count_spares(self._scores(by_rank, nodes))
        # Rank 0 holds every rank's score and node, and the spare count; every rank needs
        # them to decide.
        payload: list[Any] = [(by_rank, nodes, spares) if self.rank == 0 else None]
        dist.broadcast_object_list(payload, src=0)
        by_rank, nodes, spares = payload[0]
        scores = self._scores(by_rank, nodes)
        per_node = node_scores(scores)
        evict = self.policy.observe(per_node)
        if self.rank == 0:
            self.events.emit(
                REPORT_EVENT,
                step=step,
                source=self.source,
                threshold=self.config.threshold,
                scores=[
                    {
                        "rank": s.rank,
                        "node": s.node,
                        "score": None if math.isnan(s.score) else round(s.score, 4),
                    }
                    for s in scores
                ],
                nodes={node: round(score, 4) for node, score in sorted(per_node.items())},
                slow_streaks=dict(self.policy.streaks),
                # Every section's scores (those with a collective inside too: see
                # SCORED_SECTIONS) and rank 0's own medians, for the report and the benchmark.
                sections={
                    name: {str(r): round(v, 4) for r, v in sorted(scores.items())}
                    for name, scores in sorted(sections.items())
                },
                sections_ms=dict(getattr(self._timer, "medians_ms", {})),
            )
        if evict is None or not self.config.evict:
            return
        ranks = [s.rank for s in scores if s.node == evict]
        if spares is not None and spares < 1:
            # No Ready spare: the evicted pod's replacement would stay Pending and the job
            # would wait in the rendezvous until its join timeout, then fail. A slow node is
            # better than none: train on, report, and ask again at the next report (the
            # streak stays due, so the first report that finds a spare evicts).
            if self.rank == 0:
                self.events.emit(
                    EVICTION_DEFERRED_EVENT,
                    step=step,
                    node=evict,
                    ranks=ranks,
                    score=round(per_node[evict], 4),
                    ready_spares=None if spares == UNKNOWN_SPARES else spares,
                    cause=(
                        "the Ready hot spares could not be counted"
                        if spares == UNKNOWN_SPARES
                        else "no Ready hot spare to replace the node"
                    )
                    + f"; training on, asking again in {self.config.report_every} steps",
                )
            return
        cause = (
            f"straggler: node {evict} (ranks {ranks}) scored below {self.config.threshold} "
            f"in {self.config.reports} reports in a row (last {per_node[evict]:.2f}, "
            f"{self.source}); stopping it with a final checkpoint"
        )
        if self.rank == 0:
            self.events.emit(
                EVICTION_EVENT,
                step=step,
                node=evict,
                ranks=ranks,
                score=round(per_node[evict], 4),
                reports=self.config.reports,
                threshold=self.config.threshold,
            )
        self._eviction = NodeEviction(node=evict, cause=cause, this_node=evict == self.node)

    def eviction(self) -> NodeEviction | None:
        return self._eviction

    @staticmethod
    def _scores(by_rank: dict[int, float], nodes: dict[int, str]) -> list[RankScore]:
        return [
            RankScore(rank=r, node=nodes.get(r, "?"), score=float(by_rank.get(r, math.nan)))
            for r in range(dist.get_world_size())
        ]

    def _count_spares(self, scores: list[RankScore]) -> int | None:
        """Rank 0: the Ready spares, asked only when this report would evict (a copy of the
        policy sees it first; the API is not called every report)."""
        if self._spares is None or not self.config.evict:
            return None
        if copy.deepcopy(self.policy).observe(node_scores(scores)) is None:
            return None
        counted = self._spares()
        return UNKNOWN_SPARES if counted is None else counted

    def loop_ended(self) -> None:
        self.close()

    def close(self) -> None:
        self._timer.close()
