import torch
from task import input_t, output_t


def generate_input(m: tuple, n: tuple, k: tuple, g: int, seed: int) -> input_t:
    # GPU MODE's harness gives `m: [8, 16]` as the tuple (8, 16): anything else is not
    # what a task's generate_input is written for.
    for name, sizes in (("m", m), ("n", n), ("k", k)):
        if type(sizes) is not tuple or len(sizes) != g or any(type(x) is not int for x in sizes):
            raise TypeError(f"{name}={sizes!r}: expected a tuple of {g} ints")
    torch.manual_seed(seed)
    data = []
    for mi, ni, ki in zip(m, n, k, strict=True):
        a, b = torch.randn(mi, ki), torch.randn(ki, ni)
        data.append((a, b, torch.empty(mi, ni)))
    return data


def ref_kernel(data: input_t) -> output_t:
    return [a @ b for a, b, _ in data]


def check_implementation(data: input_t, output: output_t) -> tuple[bool, str]:
    expected = ref_kernel(data)
    if not isinstance(output, (list, tuple)) or len(output) != len(expected):
        return False, f"expected a list of {len(expected)} tensors"
    for i, (got, want) in enumerate(zip(output, expected, strict=True)):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return False, f"group {i}: {shape}, expected shape {tuple(want.shape)}"
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            return False, f"group {i}: values differ"
    return True, ""
