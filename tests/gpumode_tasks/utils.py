"""Helpers shared by the example tasks' references (GPU MODE keeps its own in ../utils.py)."""

from collections.abc import Callable
from typing import Any

import torch


def match_reference(
    ref_kernel: Callable[[Any], torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6
) -> Callable[[Any, Any], tuple[bool, str]]:
    """A check_implementation that compares the output with ref_kernel's, element by element."""

    def check_implementation(data: Any, output: Any) -> tuple[bool, str]:
        expected = ref_kernel(data)
        if not isinstance(output, torch.Tensor):
            return False, f"expected a tensor, got {type(output).__name__}"
        if output.shape != expected.shape:
            return False, f"shape {tuple(output.shape)}, expected {tuple(expected.shape)}"
        bad = ~torch.isclose(output, expected, rtol=rtol, atol=atol)
        if bool(bad.any()):
            return False, f"{int(bad.sum())} of {bad.numel()} elements differ"
        return True, ""

    return check_implementation
