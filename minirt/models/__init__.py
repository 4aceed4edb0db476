"""Model families beside DeepSeek-V3 / V3.2 (whose modules live at the package top level).

Each family is a subpackage with its config, checkpoint layout, synthetic presets and eager reference,
and offers ``plan_load(path, layers)``, ``load(path, layers, device, backend, progress)``,
``info_rows(path, cfg, layers)`` and ``RUNTIME_MISSING`` (why there is no kernel runtime, or ""): ``deepseek_v4`` (DeepSeek-V4 Flash / Pro).
``minirt.config.parse_config`` picks a family's config class by model_type, :func:`family_of` its package.
"""
from __future__ import annotations


def family_of(cfg):
    """The family package serving ``cfg`` (a parsed config), or None for DeepSeek-V3 / V3.2."""
    if cfg.model_type == "deepseek_v4":
        from . import deepseek_v4

        return deepseek_v4
    return None
