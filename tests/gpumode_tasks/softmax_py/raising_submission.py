from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    x, _ = data
    raise NotImplementedError(f"no kernel for {tuple(x.shape)} yet")
