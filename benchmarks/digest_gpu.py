"""On a CUDA device: the integrity digests are exact across devices, their speed, and the prefix check.

    python benchmarks/digest_gpu.py      # prints one JSON object

* the digest of a tensor on the GPU equals the digest of the same bytes on the
  CPU (fp32, bf16, fp16, odd sizes, an unaligned view): ranks on different
  kernels or devices compare equal bytes as equal;
* ms per GiB of the digest (one 1 GiB fp32 tensor; 200 tensors of a
  transformer's shapes through ``digest_many``), next to a ``sum()`` of the
  same tensor;
* :class:`~hf_altparams.engine.prefix._weights.PrefixWeights` on CUDA tensors
  sees a ``.data`` write.
"""

from __future__ import annotations

import json
import time

import torch

from hf_altparams.engine.digest import digest_many, digest_values, tensor_digest
from hf_altparams.engine.prefix._weights import PrefixWeights


def timed_ms(call, repeats: int = 20) -> float:  # type: ignore[no-untyped-def]
    call()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    same = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (1, 7, 63, 4097, 1_000_003):
            cpu = torch.randn(n, generator=gen).to(dtype)
            same[f"{dtype}-{n}"] = int(tensor_digest(cpu)) == int(tensor_digest(cpu.cuda()))
    base = torch.randn(10_001, generator=gen)
    same["unaligned_view"] = int(tensor_digest(base[3:])) == int(tensor_digest(base.cuda()[3:]))
    big = torch.randn(1 << 28, device="cuda")  # 1 GiB of fp32
    shapes = [(1024, 1024)] * 50 + [(4096, 1024)] * 50 + [(1024,)] * 100
    many = [torch.randn(*s, device="cuda") for s in shapes]
    many_gib = sum(t.numel() * 4 for t in many) / (1 << 30)
    net = torch.nn.Linear(64, 64).cuda()
    weights = PrefixWeights(with_buffers=True)
    weights.capture([net])
    unchanged = weights.changed([net])
    net.weight.data.copy_(torch.zeros_like(net.weight))
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(0),
                "torch": torch.__version__,
                "cpu_equals_cuda": same,
                "digest_ms_per_gib": round(timed_ms(lambda: tensor_digest(big)), 3),
                "sum_ms_per_gib": round(timed_ms(lambda: big.sum()), 3),
                "digest_many_ms_per_gib": round(timed_ms(lambda: digest_values(digest_many(many))) / many_gib, 3),
                "prefix_weights": {"unchanged": unchanged, "after_data_write": weights.changed([net])},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
