import torch
from fp8route.checkpoint.quantize import quantize_checkpoint
from fp8route.checkpoint.smollm2 import CALIBRATION, smollm2_folder
from fp8route.models.tokenizer import load_tokenizer
bf16 = smollm2_folder(fp8=False)
tok = load_tokenizer(bf16)
calib = [torch.tensor(tok.encode(t).ids) for t in CALIBRATION]
r = quantize_checkpoint(bf16, "/tmp/fp8kv/smollm2-fp8-kv", format="modelopt", calib=calib, device="cpu", kv_cache="fp8")
k = {n: s for n, s in r.kv_scales.items()}
print(len(k), min(k.values()), max(k.values()))
for n in list(k)[:6]: print(n, k[n])
