"""The Gluon prefill kernel, compiled for sm_90a on any machine (the wheel's ptxas), must not spill:
spills cost it half its speed on the H200 (docs/perf/prefill.md), and this is caught without a GPU."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_prefill_kernel_compiles_for_sm90_without_spills():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "sm90_registers.py")], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    # Both head dims, with and without attn_sink / topk_length; three partitions with their budgets.
    lines = result.stdout.splitlines()
    assert len(lines) == 4 and all(line.endswith("spill instructions 0") for line in lines), result.stdout
    assert all("setmaxnreg [" in line for line in lines)
