"""``training.tables.text_table``: the one table formatter (reports, preflight, bench, planner)."""

from __future__ import annotations

import pytest

from training.tables import text_table


def test_columns_fit_their_widest_cell_and_align_as_asked() -> None:
    lines = text_table(
        [["injob", "1.5"], ["inprocess", "12.25"]],
        headers=["mode", "s"],
        align="<>",
        indent="  ",
        rule=True,
    )
    assert lines == [
        "  mode           s",
        "  ---------  -----",
        "  injob        1.5",
        "  inprocess  12.25",
    ]


def test_short_rows_leave_their_last_columns_empty_and_no_trailing_spaces() -> None:
    lines = text_table([["a", "b", "c"], ["long"]], gap=" ")
    assert lines == ["a    b c", "long"]


def test_a_bad_alignment_names_the_argument() -> None:
    with pytest.raises(ValueError, match="align"):
        text_table([["a"]], align="^")
    with pytest.raises(ValueError, match="1 columns"):
        text_table([["a"]], align="<>")
