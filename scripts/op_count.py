"""The torch ops one eager decode step dispatches outside the kernels' wrappers, by source line: where a
step's small launches come from (each such op is at least one kernel launch on a GPU).

    minirt init /tmp/v4t --preset v4-tiny
    python3 scripts/op_count.py /tmp/v4t                 # CPU (kernels interpreted), batch 1
    python3 scripts/op_count.py /tmp/v4t --batch 4 --device cuda

Prints the total, the count per op and per source line (the innermost minirt frame), the Triton / Gluon
kernel launches by kernel, and the ops the kernels' Python wrappers dispatch (allocations, views' copies;
interpreted, also the interpreter's own) per wrapper line. Views and allocations
that launch nothing are not counted.
"""
from __future__ import annotations

import argparse
import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import minirt

NO_LAUNCH = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.view.default", "aten._unsafe_view.default",
             "aten.as_strided.default", "aten.detach.default", "aten.alias.default", "aten.t.default",
             "aten.slice.Tensor", "aten.select.int", "aten.unsqueeze.default", "aten.expand.default",
             "aten.split.Tensor", "aten.split_with_sizes.default", "aten.transpose.int", "aten.squeeze.dim",
             "aten.permute.default", "aten.unbind.int", "aten.reshape.default", "aten.lift_fresh.default"}


class TritonLaunches:
    """Counts Triton (and Gluon) kernel launches by kernel name while active, compiled or interpreted."""

    def __init__(self):
        self.by_kernel = collections.Counter()
        self._patched = []

    def __enter__(self):
        import triton.runtime.interpreter as interpreter
        import triton.runtime.jit as jit
        for cls in (jit.JITFunction, interpreter.InterpretedFunction):
            run = cls.run

            def counted(fn, *args, _run=run, **kwargs):
                self.by_kernel[getattr(fn, "__name__", None) or fn.fn.__name__] += 1
                return _run(fn, *args, **kwargs)
            cls.run = counted
            self._patched.append((cls, run))
        return self

    def __exit__(self, *exc):
        for cls, run in self._patched:
            cls.run = run


class OpCount(TorchDispatchMode):
    """Counts every dispatched op that may launch a kernel, by (file:line, op, source) of its caller."""

    def __init__(self):
        super().__init__()
        self.by_line, self.in_kernels = collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) not in NO_LAUNCH:
            frames = traceback.extract_stack()[:-1]
            wrapper = next((f for f in frames if "/kernels/" in f.filename), None)
            if wrapper is not None:
                self.in_kernels[f"{wrapper.filename.split('/')[-1]}:{wrapper.lineno}"] += 1
            else:
                own = [f for f in frames if "/minirt/" in f.filename] or frames
                f = own[-1]
                self.by_line[(f"{f.filename.split('minirt/')[-1]}:{f.lineno}", str(func), f.line)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--weights", default=None, help="fp8 or bf16 (default: minirt.load's)")
    args = parser.parse_args()
    engine = minirt.load(args.path, device=args.device, **({"weights": args.weights} if args.weights else {}))
    engine.use_cuda_graph = False
    engine.prefill([[1 + i, 2, 3, 4, 5, 6, 7][: 5 + i % 3] for i in range(args.batch)])
    tokens = torch.arange(args.batch, device=args.device) + 3
    engine.decode(tokens)  # warm: kernels compiled, caches sized
    with torch.inference_mode(), TritonLaunches() as launches, OpCount() as count:
        engine._decode_step(tokens)
    by_op = collections.Counter()
    for (_, op, _), n in count.by_line.items():
        by_op[op] += n
    print(f"torch ops outside the kernels' wrappers: {sum(by_op.values())}")
    for op, n in by_op.most_common():
        print(f"{n:5d}  {op}")
    print("--- by source line")
    for (where, op, line), n in sorted(count.by_line.items()):
        print(f"{n:5d}  {where:42s} {op:32s} {line}")
    print(f"--- Triton / Gluon kernel launches: {sum(launches.by_kernel.values())}")
    for name, n in launches.by_kernel.most_common():
        print(f"{n:5d}  {name}")
    print(f"--- dispatched inside the kernels' wrappers: {sum(count.in_kernels.values())}")
    for where, n in count.in_kernels.most_common(20):
        print(f"{n:5d}  {where}")


if __name__ == "__main__":
    main()
