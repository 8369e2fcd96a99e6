import torch
from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    return [torch.matmul(a, b, out=c) for a, b, c in data]
