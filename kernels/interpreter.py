"""Choosing the Triton interpreter when there is no GPU, whatever the process imported first.

Triton decides between interpreter and compiler for each @triton.jit function when the function is
defined, from TRITON_INTERPRET. minirt sets the variable before its own kernels are defined. But a
process that imported triton first (transformers does; any project embedding minirt may) has triton's
library functions (tl.max, tl.sum, tl.zeros, ...) defined for the compiler, and an interpreted kernel
cannot call those ("Cannot call @triton.jit'd outside of the scope of a kernel"). They are redefined
here for the interpreter, as if the variable had been set first. This happens only when the
interpreter is chosen; without a GPU nothing can run compiled, so nothing is lost.

The interpreter also re-patches triton.language (``inspect.getmembers`` over ``tl``, ``tl.tensor``,
``tl.math``: milliseconds) at every call of a @triton.jit helper inside a kernel (``tl.sum``, ``tl.max``,
``tl.sigmoid``, minirt's own helpers), although the kernel's launch has patched it for the whole run: in
kernels that call helpers in loops that was a fifth to half of their interpreted time.
``_patch_language_once_per_launch`` skips a helper's patching when its language modules are patched
already in the current launch (the same patches: nothing else changes).
"""
import inspect
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
        _patch_language_once_per_launch()


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


def _patch_language_once_per_launch() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang
    if getattr(patch_lang, "once_per_launch", False):
        return
    languages = (tl, tl.core)
    launch = {"patched": None}   # ids of the language modules patched in the running launch; None between launches
    seen: dict = {}              # function -> ids of the language modules its globals hold

    def patched_language(fn) -> frozenset:
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in languages)
        return seen[fn]

    def patch_once(fn):
        wanted = patched_language(fn)
        patched = launch["patched"]
        if patched is not None and wanted <= patched:
            return interpreter._LangPatchScope()   # a helper inside the launch: already patched
        scope = patch_lang(fn)
        if patched is not None:        # a helper seeing another language module: patched for good, as before
            launch["patched"] = patched | wanted
            return scope
        launch["patched"] = wanted     # the launch itself (GridExecutor): its restore() ends the launch
        restore = scope.restore

        def restore_and_end() -> None:
            launch["patched"] = None
            restore()

        scope.restore = restore_and_end
        return scope

    patch_once.once_per_launch = True
    interpreter._patch_lang = patch_once
