"""minirt: inference micro-runtime for DeepSeek-V3.2 MLA layers."""
