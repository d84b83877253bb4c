"""Tests of planner.sanity: published results reproduced from their own inputs.

Run: .venv/bin/python -m pytest tests/planner/test_sanity.py -q
"""

from __future__ import annotations

import pytest

from planner.sanity import kokolis


@pytest.mark.parametrize(("minutes", "published"), [(60.0, 0.70), (5.0, 0.93)])
def test_kokolis_projections_from_their_inputs(minutes: float, published: float) -> None:
    """Kokolis et al. print two digits; their first-order form and the exact one bracket them."""
    first_order, exact = kokolis(interval_min=minutes)
    assert first_order == pytest.approx(published, abs=0.025)
    assert exact == pytest.approx(published, abs=0.025)
    assert first_order <= exact  # the linear form over-counts the loss
