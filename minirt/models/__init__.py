"""Model families beside DeepSeek-V3 / V3.2 (whose modules live at the package top level).

Each family is a subpackage with its config, checkpoint layout, synthetic presets and eager reference:
``deepseek_v4`` (DeepSeek-V4 Flash / Pro). ``minirt.config.config_class`` picks a family by model_type.
"""
