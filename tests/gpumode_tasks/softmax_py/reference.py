import torch
from task import input_t, output_t
from utils import match_reference


def generate_input(rows: int, cols: int, seed: int) -> input_t:
    # The engine makes the job's device the default one: no device= needed.
    torch.manual_seed(seed)
    x = torch.randn(rows, cols) * 4
    return x, torch.empty_like(x)


def ref_kernel(data: input_t) -> output_t:
    x, _ = data
    return torch.softmax(x, dim=-1)


check_implementation = match_reference(ref_kernel)
