"""Outputs are compared in chunks (engine/compare.py: a 6.4 GB output compared whole needed
~60 GB of temporaries): the same mismatches, first index, largest errors as whole."""

from __future__ import annotations

import pytest
import torch
from kerneleval_server.engine import compare


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 26])
def test_chunked_comparison_says_what_a_whole_one_says(
    monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(compare, "COMPARE_CHUNK", chunk)
    torch.manual_seed(0)
    ref = torch.randn(5, 13, 3)
    cand = ref.clone()
    cand[1, 4, 2] += 0.5  # the first mismatch
    cand[3, 0, 0] = float("nan")
    cand[4, 12, 1] = float("inf")
    ref[2, 2, 2] = cand[2, 2, 2] = float("inf")  # equal infinities pass
    cand[0, 0, 0] += 1e-6  # within tolerance, the largest relative error of the passing ones
    check = compare.compare_outputs([cand], [ref], ["out"], 1e-4, 1e-4)
    assert not check.ok
    assert check.mismatches == 3
    assert check.elements == ref.numel()
    assert check.first_index == [1, 4, 2]
    assert check.max_abs == pytest.approx(0.5, rel=1e-6)
    assert "3 of 195 elements differ" in check.message and "first at [1, 4, 2]" in check.message


def test_a_scalar_and_an_empty_output(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compare, "COMPARE_CHUNK", 2)
    assert compare.compare_outputs([torch.tensor(1.0)], [torch.tensor(1.0)], [], None, None).ok
    bad = compare.compare_outputs([torch.tensor(2.0)], [torch.tensor(1.0)], [], None, None)
    assert not bad.ok and bad.first_index == [] and bad.mismatches == 1
    assert compare.compare_outputs([torch.empty(0, 3)], [torch.empty(0, 3)], [], None, None).ok
