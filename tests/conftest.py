import os

import torch

# Without a GPU the Triton kernels run under the interpreter; it must be chosen before any kernel
# module is imported (triton reads the variable when a @triton.jit function is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
