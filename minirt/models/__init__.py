"""The model families: one subpackage each, with its config, checkpoint layout, synthetic presets, layers,
kernel runtime, eager reference and ``verify`` rows. ``deepseek_v32`` serves DeepSeek-V3 / V3.2,
``deepseek_v4`` DeepSeek-V4 (Flash / Pro).

Every family offers the same small interface, which ``minirt.load`` and the CLI use alone:
``plan_load(path, layers)`` (a ``minirt.shards.LoadPlan``), ``tensor_specs(cfg, layers)``,
``load(path, layers, device, backend, progress, prefill_chunk=None, *, dtype, indexer_precision, weights, tp)``
(a ``minirt.backend.Backend``; ``tp`` a ``minirt.parallel.TensorParallel``, refused by
``check_tensor_parallel(cfg, tp)`` where the family cannot split that way), ``info_rows(path, cfg, layers)`` (``minirt info``),
``run_verify(engine, oracle, prompt_len, decode_steps, seed, progress, on_prefill)`` with
``default_prompt_len(cfg)``, and the refusals before loading ``check_generate_fits(cfg, layers, batch,
prompt_len, max_new_tokens, device)`` / ``check_verify_fits(cfg, layers, prompt_len, decode_steps, device)``.
``minirt.config.parse_config`` picks a family's config class by model_type, :func:`family_of` its package.
"""
from __future__ import annotations

import importlib

FAMILIES = {"deepseek_v3": "deepseek_v32", "deepseek_v32": "deepseek_v32", "deepseek_v4": "deepseek_v4"}  # model_type → package


def family_of(cfg):
    """The family package serving ``cfg`` (a parsed config, whose model_type the config parser accepted)."""
    return importlib.import_module(f"{__name__}.{FAMILIES[cfg.model_type]}")
