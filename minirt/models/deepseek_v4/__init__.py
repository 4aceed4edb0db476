"""DeepSeek-V4 (Flash / Pro): config, checkpoint layout (DeepSeek's native names), synthetic presets and
the eager fp32 reference, and the kernel runtime (``EngineV4``: MODEL1 window and compressed caches,
compressor state, CSA indexer, MoE kernels), which ``load`` serves for backend "triton"; ``run_verify``
compares the two.

    from minirt.models.deepseek_v4 import DeepseekV4Config, load_checkpoint, ReferenceModelV4
"""
from .checkpoint import load_checkpoint, plan_load, tensor_specs
from .config import DeepseekV4Config, LayerKind, V4Quantization
from .loader import check_generate_fits, check_tensor_parallel, check_verify_fits, info_rows, load
from .engine import EngineV4, build_engine_v4
from .reference import ReferenceModelV4, ReferenceOutputV4
from .verify import default_prompt_len, run_verify

__all__ = ["DeepseekV4Config", "LayerKind", "V4Quantization", "load_checkpoint", "plan_load", "tensor_specs",
           "load", "info_rows", "ReferenceModelV4", "ReferenceOutputV4", "EngineV4",
           "build_engine_v4", "run_verify", "default_prompt_len", "check_generate_fits", "check_verify_fits",
           "check_tensor_parallel"]
