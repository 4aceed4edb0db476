"""The warp-specialised Gluon kernels (sparse prefill; fp8 sparse decode for 64 and for few heads over V32
caches, and over MODEL1 caches), the MoE layers' fp8 and fp4 grouped GEMMs (Gluon) and per-assignment products (Triton) and the indexer's scores kernels, compiled for sm_90a on any machine
(the wheel's ptxas), must not spill: spills cost the prefill kernel half its speed on the H200
(docs/perf/prefill.md), and this is caught without a GPU. Nor may they, or the decode's split merge, move
q or out 2 bytes at a time (decode at h_q 128: 15% of its time, docs/perf/decode.md)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_warp_specialised_kernels_compile_for_sm90_without_spills_or_2_byte_accesses():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "sm90_registers.py")], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    # Prefill: both head dims, with and without attn_sink / topk_length; decode over V32 caches at h_q 128
    # (the 64-head kernel) and 32: final and partial results, and final results over a cache with padded
    # blocks (slot addresses by division); h_q 16; decode over MODEL1 caches (main and extra cache) at
    # h_q 128 final and partial, 32 final, 16 partial; the MoE grouped GEMM (gate/up with SwiGLU, with and
    # without V4's clamp, and down; one partition), the fp4 grouped GEMM's folded products (gate/up and down);
    # the MoE per-assignment products at one token (gate/up and
    # down, V4-Flash's fp4 experts with the fp8 shared expert in the same launches, and V3.2's fp8; Triton, no
    # partitions). Each line gives three partitions' register budgets
    # (none for the decode's split merge, a Triton kernel checked at h_q 128 and 32 for its 2-byte
    # accesses only); the indexer's scores (Triton, no partitions either) over exact and over fp8 paged keys,
    # each for a prefill chunk and a decode batch, the Gluon prefill chunk's in both formats (no partitions),
    # and over V4's CSA keys for a decode batch; fp8_gemm's
    # weight-streaming kernel at one token with split-K and without; decode_topk's three histogram passes,
    # gather and rank for long rows, its one-program selection and rank for the longest rows it takes, and
    # indexer_topk's candidate kernels for a prefill chunk: tau, candidates, overflow (Triton).
    lines = result.stdout.splitlines()
    clean = "spill instructions 0, 2-byte global accesses 0"
    # (bf16 outputs: 2-byte stores allowed)
    per_assignment = [line for line in lines if "per-assignment" in line or "stream kernel" in line]
    assert len(per_assignment) == 6 and all("spill instructions 0," in line for line in per_assignment)
    assert len(lines) == 45 and all(line.endswith(clean) for line in lines if line not in per_assignment), result.stdout
    assert [line.split()[0].rstrip(",") for line in lines] == ["prefill"] * 4 + ["decode"] * 11 + ["moe"] * 9 \
        + ["merge"] * 2 \
        + ["indexer"] * 7 + ["fp8_gemm"] * 2 + ["decode_topk"] * 7 \
        + ["indexer_topk"] * 3
    assert sum("MODEL1" in line for line in lines) == 4
    assert all("setmaxnreg [" in line for line in lines)
