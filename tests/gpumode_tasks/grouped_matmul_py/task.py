"""The grouped matmul task's types, as GPU MODE tasks declare them."""

from typing import TypedDict

import torch

input_t = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (a, b, c) per group
output_t = list[torch.Tensor]


class TestSpec(TypedDict):
    m: list[int]
    n: list[int]
    k: list[int]
    g: int
    seed: int
