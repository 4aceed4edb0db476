"""A/B of the prefill-chunk scores kernel (not part of the project): paged_indexer_scores on t 2048 queries at the
end of a 131072-key context in shuffled pages of 64, fp8 and exact keys, with indexer_cache's sm_90 module swapped
between the previous kernel (kernels/indexer_scores_old.py) and the current one; outputs compared bit for bit."""
import importlib
import torch, triton.testing
from minirt.kernels import indexer_cache
from minirt.kernels.indexer_cache import paged_indexer_scores

T, S, H, D = 2048, 131072, 64, 128
nb = S // 64
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
vals = torch.randn(nb, 64, D, device=dev, generator=g).to(torch.float8_e4m3fn)
scales = torch.rand(nb, 64, device=dev, generator=g) + 0.5
fp8_cache = torch.empty(nb, 64, 1, 132, dtype=torch.uint8, device=dev)
flat = fp8_cache.view(nb, 64 * 132)
flat[:, :64 * D] = vals.view(torch.uint8).view(nb, -1)
flat[:, 64 * D:] = scales.view(torch.uint8).view(nb, -1)
exact_cache = torch.randn(nb, 64, D, device=dev, generator=g)
table = torch.randperm(nb, device=dev, generator=g).to(torch.int32)[None]
q8 = torch.randn(1, T, H, D, device=dev, generator=g).to(torch.float8_e4m3fn)
q32 = torch.randn(1, T, H, D, device=dev, generator=g)
w = torch.randn(1, T, H, device=dev, generator=g) * 0.1
limit = (S - T + torch.arange(T, device=dev)).to(torch.int64)[None]
flops = 2 * H * D * (S - T / 2) * T
mods = {"old": importlib.import_module("minirt.kernels.indexer_scores_old"), "new": indexer_cache.indexer_scores_sm90}
print(torch.cuda.get_device_name(), flush=True)
for mode, q, cache in (("fp8", q8, fp8_cache), ("exact", q32, exact_cache)):
    outs = {}
    for name, mod in mods.items():
        indexer_cache.indexer_scores_sm90 = mod
        out = torch.full((1, T, S), float("nan"), device=dev)
        paged_indexer_scores(q, w, cache, table, limit, out=out)
        torch.cuda.synchronize()
        outs[name] = out
    print(f"{mode}: new written {not torch.isnan(outs['new']).any().item()}, bit-identical to old "
          f"{torch.equal(outs['new'], outs['old'])}, max |diff| {(outs['new'] - outs['old']).nan_to_num(0, 0, 0).abs().max().item():.2e}",
          flush=True)
    for rnd in range(3):
        for name, mod in mods.items():
            indexer_cache.indexer_scores_sm90 = mod
            out = outs[name]
            ms = triton.testing.do_bench(lambda: paged_indexer_scores(q, w, cache, table, limit, out=out), warmup=50, rep=300)
            print(f"{mode} round {rnd} {name}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
indexer_cache.indexer_scores_sm90 = mods["new"]
