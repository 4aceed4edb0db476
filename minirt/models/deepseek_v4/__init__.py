"""DeepSeek-V4 (Flash / Pro): config, checkpoint layout (DeepSeek's native names), synthetic presets and
the eager fp32 reference. The kernel runtime for V4 is not part of minirt yet.

    from minirt.models.deepseek_v4 import DeepseekV4Config, load_checkpoint, ReferenceModelV4
"""
from .config import DeepseekV4Config, LayerKind, V4Quantization

__all__ = ["DeepseekV4Config", "LayerKind", "V4Quantization"]
