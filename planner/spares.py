"""Hot spares: the pool's blocking chance, the count that keeps it below a target, and the
product's own spare count.

The pool is an Erlang loss system: ``K`` spare nodes wait, joined and with the image pulled; a
node failure takes a free spare, which is gone until the pool is refilled ``refill_s`` later (a
new instance, or the failed host back from repair); a failure that finds every spare in refill
takes none and waits for a replacement node. The chance that a failure finds no spare is then
Erlang's B formula ``B(K, a)`` with ``a = failure rate x refill time``, whatever the refill
time's distribution (the loss system is insensitive to it: Sevastyanov 1957; any queueing text,
e.g. Kleinrock, "Queueing Systems" vol. 1, sec. 3.7).

The spare count the product deploys has one owner: a ``spares`` field of the size rows in
``manifests/sizes.py``, which the node group (`make gpu-nodes OVERLAY=...`) and the Job's spare
placeholders read too. For a size that no overlay has, :func:`spares_in_force` returns the
planner's recommendation and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from manifests.sizes import SIZES

NO_SPARE_TARGET = 0.01
"""The chance of finding no spare that the recommended count stays below."""


def erlang_b(*, spares: int, load: float) -> float:
    """B(K, a): the chance that a failure finds all ``spares`` in refill; ``load`` = a."""
    if spares < 0 or load < 0:
        raise ValueError("spares and load must be >= 0")
    b = 1.0
    for k in range(1, spares + 1):
        b = load * b / (k + load * b)
    return b


def spares_needed(*, load: float, target: float = NO_SPARE_TARGET, limit: int = 10_000) -> int:
    """The fewest spares whose blocking chance is below ``target``."""
    if not 0 < target < 1:
        raise ValueError("target must be within (0, 1)")
    b, k = 1.0, 0
    while b >= target:
        k += 1
        if k > limit:
            raise ValueError(f"more than {limit} spares needed (load {load:g})")
        b = load * b / (k + load * b)
    return k


@dataclass(frozen=True, kw_only=True)
class SparesInForce:
    """The spare count a plan uses and where it comes from."""

    count: int
    """Spare nodes."""
    origin: str
    """``manifests.sizes:<row>`` (the product's count), ``--hot-spares`` or ``recommended``."""


def product_spares(*, nodes: int) -> tuple[int, str] | None:
    """The product's spare count for a job of ``nodes`` nodes, from its single owner: the
    ``spares`` of the ``manifests.sizes.SIZES`` overlay with that many nodes, and that overlay's
    name. None when no overlay has that many nodes."""
    for name, size in SIZES.items():
        if size.nodes == nodes:
            return size.spares, f"manifests.sizes:{name}"
    return None


def spares_in_force(*, nodes: int, given: int | None, recommended: int) -> SparesInForce:
    """The one place the planner decides which spare count it plans with."""
    if given is not None:
        return SparesInForce(count=given, origin="--hot-spares")
    product = product_spares(nodes=nodes)
    if product is not None:
        return SparesInForce(count=product[0], origin=product[1])
    return SparesInForce(count=recommended, origin="recommended")
