"""A DCT chunk whose basis would not fit is refused where it is given, before any step."""

from __future__ import annotations

import pytest
import torch

from flexdemo import DeMoReplicator, FlexDeMo
from flexdemo.knobs import MAX_DCT_CHUNK

TOO_BIG = [MAX_DCT_CHUNK + 1, 1_000_000]


@pytest.mark.parametrize("chunk", [*TOO_BIG, 0, True, 2.0])
def test_the_optimizer_refuses_the_same_chunk_in_one_sentence(chunk: object) -> None:
    # A weight with a long dimension: chunk 10**6 would have built a 50_000 x 50_000 basis.
    weight = torch.nn.Parameter(torch.zeros(2, 50_000))
    with pytest.raises(ValueError, match=rf"^compression_chunk={chunk!r} must be an integer from "
                                         rf"1 to {MAX_DCT_CHUNK}: ") as err:
        FlexDeMo([weight], lr=1e-3, compression_chunk=chunk)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=rf"^chunk={chunk!r} must be an integer from 1 to"):
        DeMoReplicator(chunk=chunk)


def test_the_largest_chunk_is_still_taken() -> None:
    assert DeMoReplicator(chunk=MAX_DCT_CHUNK).chunk == MAX_DCT_CHUNK
