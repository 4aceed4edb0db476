"""DeepSeek-V3 / V3.2: checkpoint layout (Hugging Face names), the kernel layers and runtime (``Engine``: fp8
paged cache, lightning indexer, MoE kernels), which ``load`` serves for backend "triton", the eager fp32
reference, and ``minirt verify``'s rows (``run_verify``).

    from minirt.models.deepseek_v32 import load_checkpoint, ReferenceModel, Engine
"""
from .checkpoint import load_checkpoint, plan_load, tensor_specs
from .engine import Engine, build_engine
from .loader import info_rows, load
from .memory import check_generate_fits, check_verify_fits
from .reference import ReferenceModel, ReferenceOutput
from .verify import default_prompt_len, run_verify
from .parallel import check_tensor_parallel

__all__ = ["load_checkpoint", "plan_load", "tensor_specs", "load", "info_rows", "ReferenceModel", "ReferenceOutput",
           "Engine", "build_engine", "run_verify", "default_prompt_len", "check_generate_fits", "check_verify_fits",
           "check_tensor_parallel"]
