import torch
from fp8route.checkpoint.load import load_checkpoint
from fp8route.engine.kv_quant import KVScales, RoundTripAttention
from fp8route.models.llama import LlamaForCausalLM, rope_tables
from fp8route.models.tokenizer import load_tokenizer
folder = "/tmp/fp8kv/smollm2-fp8-kv"
ck = load_checkpoint(folder, "cpu")
m = LlamaForCausalLM.from_checkpoint(ck).eval()
L = m.cfg.num_hidden_layers
cal = KVScales.from_tensors(ck.kv_scales, L, folder)
tok = load_tokenizer(folder)
ids = torch.tensor(tok.encode(open("benchmarks/results/heldout/boolq_val_passages.txt").read()).ids)
ids = ids[len(ids) // 2 : len(ids) // 2 + 8 * 512].view(8, 512)  # held out: the file's middle
def run(ctx):
    with torch.no_grad():
        h = m.model.embed_tokens(ids).float()
        cos, sin = rope_tables(m.cfg, torch.arange(512))
        return m.lm_head(m.model.run_layers(h, cos, sin, ctx)).log_softmax(-1)
ref = run(None)
arms = {"calibrated": cal, "calibrated x1.5": KVScales(tuple(1.5 * s for s in cal.k), tuple(1.5 * s for s in cal.v), "x"),
        "1.0": KVScales.ones(L)}
for name, s in arms.items():
    out = run(RoundTripAttention(s))
    top1 = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - out)).sum(-1).mean().item()
    nll = lambda lp: -lp[:, :-1].gather(-1, ids[:, 1:, None]).mean().item()
    print(f"{name}: top1 {top1:.4f} KL {kl:.4f} NLL {nll(out):.4f} (auto {nll(ref):.4f})")
