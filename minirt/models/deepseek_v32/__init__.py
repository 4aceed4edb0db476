"""DeepSeek-V3 / V3.2: checkpoint layout (Hugging Face names), the kernel layers and runtime, the fp8 paged
cache, the eager fp32 reference and ``minirt verify``'s rows."""
