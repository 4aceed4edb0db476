"""The two ceilings every benchmark reports, measured in the same run (METHOD: measure, don't quote).

bf16 matmul 8192³ on random data (TFLOP/s) and a 1 GiB device-to-device copy of random bytes
(GB/s, bytes read + written), medians of triton.testing.do_bench; and the fp8 tensor-core ceiling
the fp8 indexer computes on (measure_fp8_tflops).
"""
import sys

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


def measure_fp8_tflops(device="cuda") -> float:
    """The fp8 tensor-core ceiling (TFLOP/s): an e4m3 product 8192^3 of random data through
    torch._scaled_mm (bf16 out), what the fp8 indexer computes on."""
    n = 8192
    one = torch.ones((), device=device)
    a8, b8 = (torch.randn(n, n, device=device).to(torch.float8_e4m3fn) for _ in range(2))
    ms = do_bench(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                  return_mode="median")
    return 2 * n**3 / ms / 1e9


def plot_roofline(path: str, title: str, points: list[tuple[str, float, float, float]],
                  matmul_tflops: float, copy_gbps: float) -> None:
    """Roofline PNG: each point (label, flops, bytes, seconds) at its intensity (FLOP per byte of the
    fewest bytes the kernel must move) and achieved TFLOP/s, under the two measured ceilings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    intensities = [f / b for _, f, b, _ in points]
    lo, hi = min(intensities + [1.0]) / 4, max(intensities + [matmul_tflops * 1e3 / copy_gbps]) * 4
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [min(matmul_tflops, copy_gbps * x / 1e3) for x in xs], "k-",
            label=f"ceiling: {matmul_tflops:.0f} TFLOP/s bf16 matmul, {copy_gbps:.0f} GB/s copy")
    for (label, flops, nbytes, seconds), x in zip(points, intensities):
        y = flops / seconds / 1e12
        # Labels go to the legend: points of equal intensity would overprint annotations.
        ax.plot([x], [y], "o", label=f"{label}: {y:.0f} TFLOP/s, {nbytes / seconds / 1e9:.0f} GB/s")
    ax.set(xscale="log", yscale="log", xlabel="FLOP per byte (minimum traffic)", ylabel="TFLOP/s", title=title)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_report(text: str, out: str) -> None:
    """The markdown report to the file ``out``, or to stdout when ``out`` is "-"."""
    if out == "-":
        sys.stdout.write("\n" + text)
    else:
        with open(out, "w") as f:
            f.write(text)
