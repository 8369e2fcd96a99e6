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


def _errors_one_by_one(cand: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """The largest finite absolute and relative errors, element by element in Python."""
    max_abs = max_rel = 0.0
    for c, r in zip(cand.double().flatten().tolist(), ref.double().flatten().tolist(), strict=True):
        diff = abs(c - r)
        if diff == diff and diff != float("inf"):
            max_abs = max(max_abs, diff)
            if r != 0:
                max_rel = max(max_rel, diff / abs(r))
    return max_abs, max_rel


@pytest.mark.parametrize("chunk", [3, 1 << 26])
def test_errors_read_back_at_once_are_those_of_the_finite_elements(
    monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """A chunk's largest errors and mismatch count come back from the device in one read:
    NaN and infinite errors are left out of the largest ones, and a reference's zeros out of
    the relative one, as element by element."""
    monkeypatch.setattr(compare, "COMPARE_CHUNK", chunk)
    torch.manual_seed(1)
    ref = torch.randn(40)
    cand = ref * 1.001  # a relative error of 1e-3 everywhere
    ref[5] = 0.0  # relative error undefined: left out
    cand[5] = 0.25  # the largest absolute error
    cand[9] = float("nan")
    cand[17] = float("-inf")
    ref[23] = cand[23] = float("inf")
    ref[30] = 1e-30  # the largest relative error: a tiny reference value
    cand[30] = 2e-30
    check = compare.compare_outputs([cand], [ref], ["out"], 1e-4, 1e-4)
    max_abs, max_rel = _errors_one_by_one(cand, ref)
    assert check.max_abs == max_abs == pytest.approx(0.25)
    assert check.max_rel == max_rel == pytest.approx(1.0)
    wrong = [
        i
        for i, (c, r) in enumerate(zip(cand.tolist(), ref.tolist(), strict=True))
        if not (c == r or abs(c - r) <= 1e-4 + 1e-4 * abs(r))
    ]
    assert check.mismatches == len(wrong) and check.first_index == [wrong[0]]
    nothing_finite = compare.compare_outputs(
        [torch.full((4,), float("nan"))], [torch.ones(4)], ["out"], None, None
    )
    assert nothing_finite.max_abs == 0.0 and nothing_finite.max_rel == 0.0
    assert nothing_finite.mismatches == 4


def test_an_infinite_reference_value_is_matched_only_by_the_same_infinity() -> None:
    """rtol times an infinite reference value is no bound: a finite value, or the other
    infinity, where the reference has one is a mismatch (as torch.isclose says)."""
    ref = torch.tensor([1.0, float("inf"), float("-inf"), float("inf"), 2.0])
    cand = torch.tensor([1.0, 0.0, float("inf"), float("inf"), float("inf")])
    check = compare.compare_outputs([cand], [ref], ["out"], 1e-4, 1e-4)
    assert not check.ok and check.mismatches == 3 and check.first_index == [1]
    close = torch.isclose(cand, ref, rtol=1e-4, atol=1e-4)
    assert check.mismatches == int((~close).sum())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32])
def test_a_small_output_compared_on_the_host_says_what_the_device_says(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """Outputs of up to HOST_COMPARE_MAX elements are copied to the host and compared there
    (a comparison's kernel launches cost more than the copy): the same verdict, errors and
    first index as on the device, for each dtype."""
    torch.manual_seed(1)
    ref = (torch.randn(64, 64) * 100).to(dtype).cuda()
    ref.view(-1)[77], ref.view(-1)[1000] = 1, 2
    cand = ref.clone()
    flat = cand.view(-1)
    flat[77] += 3
    flat[1000] += 5
    if dtype.is_floating_point:
        flat[2000] = float("nan")
        flat[5] = ref.view(-1)[5] + 1e-5 * ref.view(-1)[5].abs()  # within tolerance
    assert ref.numel() <= compare.HOST_COMPARE_MAX
    checks = []
    for host_max in (compare.HOST_COMPARE_MAX, 0):
        monkeypatch.setattr(compare, "HOST_COMPARE_MAX", host_max)
        checks.append(compare.compare_outputs([cand], [ref], ["out"], None, None))
    on_host, on_device = checks
    assert not on_host.ok and on_host == on_device
    assert on_host.first_index == [1, 13]


def _edge_cases(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(candidate, reference) pairs with what the comparison's rules are about: NaN, equal and
    unequal infinities, a zero reference (no relative error there), tolerances, empty."""
    torch.manual_seed(3)
    ref = (torch.randn(32, 50) * 10).to(dtype)
    ref.view(-1)[:4] = 0
    near = ref.clone()
    if dtype.is_floating_point:
        near.view(-1)[10] += 1e-5 * float(ref.view(-1)[10].abs())  # within the tolerance
    wrong = ref.clone()
    wrong.view(-1)[[3, 99, 1000]] += 7  # one where the reference is 0
    pairs = [(ref.clone(), ref), (near, ref), (wrong, ref), (ref[:0], ref[:0])]
    if dtype.is_floating_point:
        special = ref.clone()
        special.view(-1)[[5, 6, 7]] = float("inf")
        cand = special.clone()
        cand.view(-1)[6] = float("-inf")  # the reference's +inf
        cand.view(-1)[8] = float("nan")
        both_nan = ref.clone()
        both_nan.view(-1)[9] = float("nan")  # NaN never passes, not even against NaN
        pairs += [(special.clone(), special), (cand, special), (both_nan.clone(), both_nan)]
    return pairs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32])
def test_the_host_comparison_in_numpy_says_what_torchs_says(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """A small output is compared on the host in numpy (compare._compare_on_host), a large
    one in torch: for every rule, the same verdict, errors, mismatch count and first index."""
    for cand, ref in _edge_cases(dtype):
        checks = []
        for host_max in (compare.HOST_COMPARE_MAX, 0):
            monkeypatch.setattr(compare, "HOST_COMPARE_MAX", host_max)
            checks.append(compare.compare_outputs([cand], [ref], ["out"], None, None))
        assert checks[0] == checks[1], (cand, ref)
    wrong, ref = _edge_cases(dtype)[2]
    check = compare.compare_outputs([wrong], [ref], ["out"], None, None)
    assert not check.ok and check.mismatches == 3 and check.first_index == [0, 3]
    # Identical on the host (compare.identical_small: one op): passes with no error...
    same = compare.compare_outputs([ref.clone()], [ref], ["out"], None, None)
    assert same.ok and same.max_abs == same.max_rel == 0.0
    if dtype.is_floating_point:  # ...where no NaN is: a NaN in both still fails
        nan_cand, nan_ref = _edge_cases(dtype)[-1]
        assert not compare.identical_small(nan_cand, nan_ref)
        assert not compare.compare_outputs([nan_cand], [nan_ref], ["out"], None, None).ok


def test_chunks_equal_bit_for_bit_are_skipped_and_the_others_still_judged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past HOST_COMPARE_MAX, chunks equal bit for bit skip the float64 passes: the chunks
    after them are still judged, and a NaN in both outputs at one place still fails."""
    monkeypatch.setattr(compare, "COMPARE_CHUNK", 1000)
    torch.manual_seed(0)
    ref = torch.randn(40_000)
    cand = ref.clone()
    cand[25_500] += 0.25  # in the 26th chunk, after 25 equal ones
    cand[30_000] += 2e-5  # within the tolerance
    check = compare.compare_outputs([cand], [ref], ["out"], 1e-4, 1e-4)
    assert not check.ok and check.mismatches == 1 and check.first_index == [25_500]
    assert check.max_abs == pytest.approx(0.25, rel=1e-5)
    same = compare.compare_outputs([ref.clone()], [ref], ["out"], 1e-4, 1e-4)
    assert same.ok and same.max_abs == 0.0
    ref[39_999] = cand[39_999] = float("nan")
    both_nan = compare.compare_outputs([ref.clone()], [ref], ["out"], 1e-4, 1e-4)
    assert not both_nan.ok and both_nan.first_index == [39_999]
