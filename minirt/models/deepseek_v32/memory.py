"""How much memory ``minirt generate`` and ``minirt verify`` will take on a DeepSeek-V3.2 checkpoint, and
the refusals (before anything is loaded) when the device has less free."""
from __future__ import annotations

import torch
from rich.filesize import decimal

from ...device import available_memory
from ...errors import InputError
from ...formats import CACHE_BLOCK_SIZE
from ...shards import READ_CHUNK_BYTES
from .cache import cache_bytes_per_token
from .checkpoint import tensor_specs, weight_memory_bytes
from .reference import forward_peak_bytes


def generate_memory_bytes(cfg, num_layers: int, batch: int, prompt_len: int, max_new_tokens: int, device) -> int:
    """Estimated peak memory of ``minirt generate`` (triton backend) on ``device``: the weights (fp32 on
    cpu, bf16 on cuda: an upper bound for fp8 ones), every sequence's cache blocks (capacity rounded up
    to the block size), a prefill's bf16 latents of every prompt token per layer (``KVStash``), the
    logits of a step and the loader's read chunks."""


    weights = weight_memory_bytes(cfg, tensor_specs(cfg, num_layers),
                                  torch.bfloat16 if device.type == "cuda" else torch.float32, fp8_as_stored=False)
    capacity = -(-(prompt_len + max_new_tokens) // CACHE_BLOCK_SIZE) * CACHE_BLOCK_SIZE
    cache = cache_bytes_per_token(cfg, num_layers) * batch * capacity
    stash = batch * prompt_len * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 * num_layers
    logits = 3 * batch * cfg.vocab_size * 4  # the step's, its softmax in sampling, the sampled copy
    return weights + cache + stash + logits + 8 * READ_CHUNK_BYTES


def check_generate_fits(cfg, num_layers: int, batch: int, prompt_len: int, max_new_tokens: int, device) -> None:
    """InputError, with the numbers and the largest --batch that fits, when generate's memory estimate
    exceeds what the device has free: before anything is loaded."""
    need, free = generate_memory_bytes(cfg, num_layers, batch, prompt_len, max_new_tokens, device), available_memory(device)
    if need <= free:
        return
    base = generate_memory_bytes(cfg, num_layers, 0, prompt_len, max_new_tokens, device)
    per_sequence = (need - base) / batch
    fits = int((free - base) // per_sequence) if free > base else 0
    advice = f"at most --batch {fits} fits" if fits >= 1 else "not even one sequence fits"
    raise InputError(f"generate --batch {batch} over {prompt_len} + {max_new_tokens} tokens needs about {decimal(need)} "
                     f"on {device.type} (weights, cache, prefill latents), {decimal(free)} is available: {advice}")


def verify_memory_bytes(cfg, num_layers: int, num_tokens: int, device) -> int:
    """Estimated peak memory of ``minirt verify`` over ``num_tokens`` tokens on ``device``: both models'
    weights (the runtime's bf16 on cuda, an upper bound for its fp8 weights, fp32 on cpu; the reference's
    fp32; the routed experts of both as stored; loading holds one copy plus its read chunks), the runtime's cache and its two runs' logits, and the
    eager reference's activations (``reference.forward_peak_bytes``)."""


    specs = tensor_specs(cfg, num_layers)
    weights = sum(weight_memory_bytes(cfg, specs, dtype, fp8_as_stored=False)
                  for dtype in (torch.bfloat16 if device.type == "cuda" else torch.float32, torch.float32))
    weights += 8 * READ_CHUNK_BYTES
    runtime = cache_bytes_per_token(cfg, num_layers) * num_tokens + 2 * num_tokens * cfg.vocab_size * 4
    return weights + runtime + forward_peak_bytes(cfg, num_layers, num_tokens)


def check_verify_fits(cfg, num_layers: int, prompt_len: int, decode_steps: int, device) -> None:
    """InputError, with the numbers and the longest prompt that fits, when verify's memory estimate exceeds
    what the device has free: before anything is loaded."""
    total = prompt_len + decode_steps
    need, free = verify_memory_bytes(cfg, num_layers, total, device), available_memory(device)
    if need > free:
        fits, low, high = 0, 1, total  # the largest token count that fits (the estimate grows with it)
        while low <= high:
            mid = (low + high) // 2
            if verify_memory_bytes(cfg, num_layers, mid, device) <= free:
                fits, low = mid, mid + 1
            else:
                high = mid - 1
        advice = (f"at most --prompt-len {fits - decode_steps} with --decode-steps {decode_steps} fits"
                  if fits > decode_steps else "not even one prompt token fits")
        raise InputError(f"verify over {total} tokens needs about {decimal(need)} on {device.type} (the eager reference "
                         f"holds [heads, T, T] attention scores), {decimal(free)} is available: {advice}")
