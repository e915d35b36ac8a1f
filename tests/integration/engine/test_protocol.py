import pytest

from slime_mt.engine.protocol import (
    collapse_image_pads,
    expand_image_pads,
)

PAD = 151655


@pytest.mark.parametrize(
    "expanded,engine,counts",
    [
        ([1, PAD, PAD, PAD, 2], [1, PAD, 2], [3]),
        ([PAD, PAD, 5, PAD, 7, PAD, PAD], [PAD, 5, PAD, 7, PAD], [2, 1, 2]),
        ([1, 2, 3], [1, 2, 3], []),
    ],
)
def test_image_pad_views_round_trip(expanded, engine, counts):
    assert collapse_image_pads(expanded, PAD) == (engine, counts)
    assert expand_image_pads(engine, PAD, counts) == expanded
