"""Gather bandwidth against the bytes each SM keeps in flight, on the decode benchmark's access pattern.

    python3 scripts/bench_gather.py --out gather-run.md

The fp8 decode kernels read 656-byte cache tokens at random addresses (bench_decode's cache: 2.75 GB,
128 sequences of 32768 tokens in shuffled 64-token pages; the slots of its h_q 16 s_q 1 row). How fast
that can go depends on how many bytes are in flight: here k persistent programs per SM each loop over
T-token chunks, loading one chunk at a time (no software pipelining), so about k * T * 656 bytes are in
flight per SM. The decode producers hold theirs in registers (three 16-token pieces each); this table says
what a given number of bytes in flight buys.

A second table asks whether TMA would gather faster on Hopper (no gather4 there): one copy per token, a
[1, BOX] int32 box of the cache seen as [slots, 164] int32 (columns past 164 are out of bounds: zero-filled
in shared memory, not read), into a ring of RING 16-token chunks per program, each chunk on one mbarrier.
Slot ids are either read from memory per token (the decode pattern) or computed (what the copies alone
cost). Times are medians of do_bench over CUDA-graph replays (L2 cleared before each); ceilings (matmul,
copy) are measured in the same run.
"""
from __future__ import annotations

import argparse
import datetime

import torch
import triton
from bench_decode import SEQLEN, TOPK, bench_ms, build_cache, build_queries, gather_tokens_kernel
from ceilings import measure_ceilings, write_report

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from minirt.formats import KV_TOKEN_BYTES

SEQUENCES = 128   # bench_decode's batch: the slots of its h_q 16 s_q 1 row
# (tokens per chunk, warps); programs per SM for each.
SHAPES = [(16, 4), (32, 4), (64, 8)]
PROGRAMS_PER_SM = [1, 2, 3, 4, 6, 8]
TMA_CHUNK = gl.constexpr(16)   # tokens per mbarrier
# (box columns, programs per sequence, ring chunks, slot ids read from memory): the box that covers a
# token (256 >= 164 words), then halves of it, which do not (their rows say what a copy costs by size).
TMA_CASES = [(256, 1, 4, True), (256, 2, 4, True), (256, 4, 2, True), (256, 8, 1, True), (256, 1, 4, False),
             (256, 2, 4, False), (256, 4, 2, False), (256, 8, 1, False), (128, 2, 4, False), (64, 2, 4, False)]


@gluon.jit
def _tma_issue_chunk(desc, slots_row, chunk, ring, ready, n_slots, RING: gl.constexpr, READ_IDS: gl.constexpr):
    """Copy the 16 tokens of `chunk` into ring buffer chunk % RING, counted on its barrier."""
    buf = chunk % RING
    mbarrier.expect(ready.index(buf), TMA_CHUNK * desc.block_type.nbytes)
    for j in gl.static_range(TMA_CHUNK):
        if READ_IDS:
            slot = gl.load(slots_row + chunk * TMA_CHUNK + j)
        else:   # a scattered slot from the position alone (int32 wrap-around, then a non-negative remainder)
            slot = (((gl.program_id(0) * 4096 + chunk * TMA_CHUNK + j) * 40503) & 0x7FFFFFFF) % n_slots
        tma.async_copy_global_to_shared(desc, [slot, 0], ready.index(buf), ring.index(buf).slice(j, 1))


@gluon.jit
def tma_gather_kernel(desc, slots_ptr, out_ptr, n_per_program, n_slots, RING: gl.constexpr, READ_IDS: gl.constexpr):
    """Gather the program's n_per_program tokens by TMA, RING chunks in flight; out[pid] = the first
    row of ring buffer 0 (the last chunk it held), so the copies are checked and kept."""
    box: gl.constexpr = desc.block_type.shape[1]
    slots_row = slots_ptr + gl.program_id(0) * n_per_program
    ring = gl.allocate_shared_memory(gl.int32, [RING, TMA_CHUNK, box], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RING):
        mbarrier.init(ready.index(i), count=1)
    n_chunks = n_per_program // TMA_CHUNK
    for chunk in gl.static_range(RING):
        _tma_issue_chunk(desc, slots_row, chunk, ring, ready, n_slots, RING, READ_IDS)
    for chunk in range(n_chunks):
        mbarrier.wait(ready.index(chunk % RING), (chunk // RING) & 1)
        gl.thread_barrier()   # every warp has seen the chunk land before its buffer is refilled
        if chunk + RING < n_chunks:
            _tma_issue_chunk(desc, slots_row, chunk + RING, ring, ready, n_slots, RING, READ_IDS)
    row_l: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
    gl.store(out_ptr + gl.program_id(0) * box + gl.arange(0, box, gl.SliceLayout(0, row_l))[None, :],
             ring.index(0).slice(0, 1).load(row_l))


def tma_rows(cache, slots) -> list:
    """TMA_CASES as table rows; each case's copies checked against the cache."""
    words = cache.view(-1, KV_TOKEN_BYTES).view(torch.int32)   # [slots, 164]
    token_words = words.shape[1]
    sms = torch.cuda.get_device_properties(slots.device).multi_processor_count
    rows = []
    for box, per_seq, ring, read_ids in TMA_CASES:
        desc = TensorDescriptor.from_tensor(words, [1, box], gl.NVMMASharedLayout(swizzle_byte_width=0,
                                                                                   element_bitwidth=32, rank=2))
        programs = slots.view(SEQUENCES * per_seq, -1)
        out = torch.empty(programs.shape[0], box, dtype=torch.int32, device=slots.device)
        run = lambda: tma_gather_kernel[(programs.shape[0],)](desc, programs, out, programs.shape[1], words.shape[0],  # noqa: E731
                                                              RING=ring, READ_IDS=read_ids, num_warps=4)
        run()
        if read_ids:
            chunk = TMA_CHUNK.value
            last = (programs.shape[1] // chunk - 1) // ring * ring * chunk
            if not (torch.equal(out[:, :token_words], words[programs[:, last].long()])
                    and bool((out[:, token_words:] == 0).all())):
                raise SystemExit(f"TMA gather (box {box}, {per_seq} programs a sequence) copied the wrong bytes")
        ms = bench_ms(run)
        read = min(box, token_words) * 4
        rows.append(f"| {box} | {'memory' if read_ids else 'computed'} | {per_seq} | {ring * TMA_CHUNK.value * read / 1024:.0f} | "
                    f"{ms * 1e3:.1f} | {slots.numel() * read / ms / 1e6:.0f} | "
                    f"{ms * 1e6 * sms / slots.numel():.1f} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="-", help="write the markdown report here (default: stdout)")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    peak_tflops, copy_gbps = measure_ceilings("cuda")
    cache, table = build_cache(SEQUENCES, SEQLEN, "cuda")
    slots = build_queries(SEQUENCES, 1, 16, SEQLEN, TOPK, table, seed=1016)[2].reshape(-1)
    rows = []
    for tokens, warps in SHAPES:
        for k in PROGRAMS_PER_SM:
            out = torch.empty(props.multi_processor_count * k, dtype=torch.int32, device="cuda")
            ms = bench_ms(lambda: gather_tokens_kernel[(out.numel(),)](cache.view(torch.int32), slots, out,
                                                                        slots.numel() // tokens, T=tokens,
                                                                        PERSISTENT=True, num_warps=warps))
            rows.append(f"| {tokens} | {warps} | {k} | {k * tokens * KV_TOKEN_BYTES / 1024:.0f} | "
                        f"{slots.numel() * KV_TOKEN_BYTES / ms / 1e6:.0f} |")
            print(rows[-1], flush=True)
    header = (f"GPU: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
              f"triton {triton.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n"
              f"Ceilings (same run): bf16 matmul 8192^3 {peak_tflops:.0f} TFLOP/s; device copy {copy_gbps:.0f} GB/s "
              f"(read + write)\n{slots.numel()} random tokens of 656 bytes\n\n")
    table_md = ("| tokens per chunk | warps | programs per SM | ~KB in flight per SM (if all resident) | GB/s |\n"
                "|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")
    table_md += (f"\nOne TMA copy per token ({SEQUENCES} sequences of {TOPK} tokens; programs per sequence share its "
                 "slots):\n\n"
                 "| box (int32) | slot ids | programs per sequence | KB read in flight per program | µs | GB/s read | "
                 "ns per copy per SM |\n|---:|---|---:|---:|---:|---:|---:|\n" + "\n".join(tma_rows(cache, slots)) + "\n")
    write_report(header + table_md, args.out)


if __name__ == "__main__":
    main()
