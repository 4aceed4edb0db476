"""Choosing the Triton interpreter when there is no GPU, whatever the process imported first.

Triton decides between interpreter and compiler for each @triton.jit function when the function is
defined, from TRITON_INTERPRET. minirt sets the variable before its own kernels are defined. But a
process that imported triton first (transformers does; any project embedding minirt may) has triton's
library functions (tl.max, tl.sum, tl.zeros, ...) defined for the compiler, and an interpreted kernel
cannot call those ("Cannot call @triton.jit'd outside of the scope of a kernel"). They are redefined
here for the interpreter, as if the variable had been set first. This happens only when the
interpreter is chosen; without a GPU nothing can run compiled, so nothing is lost.
"""
import os
import sys
import types

import torch


def choose_interpreter_without_gpu() -> None:
    """Set TRITON_INTERPRET=1 when torch sees no GPU (unless the user set it), and make triton's
    library functions interpretable if triton was imported before the variable was set."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        _interpret_triton_library()


def _interpret_triton_library() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    import triton.language as tl

    converted: dict[int, InterpretedFunction] = {}  # by id: a JITFunction's hash compiles its dependencies

    def interpreted(fn: JITFunction) -> InterpretedFunction:
        if id(fn) not in converted:
            converted[id(fn)] = InterpretedFunction(fn.fn, do_not_specialize=fn.do_not_specialize,
                                                    noinline=fn.noinline)
        return converted[id(fn)]

    namespaces = [tl.tensor] + [m for name, m in list(sys.modules.items())
                                if name.startswith("triton.language") and isinstance(m, types.ModuleType)]
    for namespace in namespaces:
        for name, value in list(vars(namespace).items()):
            if isinstance(value, JITFunction):
                setattr(namespace, name, interpreted(value))
