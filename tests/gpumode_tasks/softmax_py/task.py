"""The softmax task's types, as GPU MODE tasks declare them."""

from typing import TypedDict

import torch

input_t = tuple[torch.Tensor, torch.Tensor]  # (x, out)
output_t = torch.Tensor


class TestSpec(TypedDict):
    rows: int
    cols: int
    seed: int
