import torch
from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    x, out = data
    e = (x - x.max(dim=-1, keepdim=True).values).exp()
    return torch.div(e, e.sum(dim=-1, keepdim=True), out=out)
