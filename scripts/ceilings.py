"""The two ceilings every benchmark reports, measured in the same run (METHOD: measure, don't quote).

bf16 matmul 8192³ on random data (TFLOP/s) and a 1 GiB device-to-device copy of random bytes
(GB/s, bytes read + written), medians of triton.testing.do_bench.
"""
import torch
from triton.testing import do_bench


def measure_ceilings(device="cuda") -> tuple[float, float]:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    tflops = 2 * 8192**3 / do_bench(lambda: a @ b, return_mode="median") / 1e9
    del a, b
    src = torch.randint(0, 256, (2**30,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    gbps = 2 * src.numel() / do_bench(lambda: dst.copy_(src), return_mode="median") / 1e6
    return tflops, gbps
