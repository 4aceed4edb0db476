"""DeepSeek-V4 (Flash / Pro): config, checkpoint layout (DeepSeek's native names), synthetic presets and
the eager fp32 reference. The kernel runtime for V4 is not part of minirt yet: ``load`` serves the
reference backend only.

    from minirt.models.deepseek_v4 import DeepseekV4Config, load_checkpoint, ReferenceModelV4
"""
from .checkpoint import load_checkpoint, plan_load, tensor_specs
from .config import DeepseekV4Config, LayerKind, V4Quantization
from .loader import RUNTIME_MISSING, info_rows, load
from .reference import ReferenceModelV4, ReferenceOutputV4

__all__ = ["DeepseekV4Config", "LayerKind", "V4Quantization", "load_checkpoint", "plan_load", "tensor_specs",
           "load", "info_rows", "RUNTIME_MISSING", "ReferenceModelV4", "ReferenceOutputV4"]
