"""Where a decode step's time goes: SmolLM2-135M FP8 (cpu_dequant) against bf16, torch profiler.

Each model generates 33 tokens greedily from 35 random prompt ids (after a warm-up), once timed
plainly and once under the profiler; FP8 runs again after bf16 so a slow spell shows.
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from fp8route.checkpoint.smollm2 import smollm2_folder
from fp8route.models.load import load_model

for fp8 in (True, False, True):
    model = load_model(smollm2_folder(fp8=fp8), "cpu", dtype=torch.bfloat16, max_batch_size=1, max_seq_len=128)
    ids = torch.randint(100, 1000, (1, 35), generator=torch.Generator().manual_seed(0))
    model.generate(ids, 8)
    start = time.perf_counter()
    model.generate(ids, 33)
    print(f"{'fp8' if fp8 else 'bf16'}: 33 tokens in {time.perf_counter() - start:.3f} s without the profiler")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.generate(ids, 33)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
