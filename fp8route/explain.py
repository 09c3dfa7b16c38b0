"""Print what every Fp8Linear in a model will run, and why the rest will not."""

from __future__ import annotations

from torch import nn

from fp8route.layer import Fp8Linear


def explain(model: nn.Module) -> str:
    """One block per distinct plan; layers that share a plan are listed together."""
    groups: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            body = module.plan.explain().split("\n", 1)
            header = body[0].replace(module.plan.layer, "", 1).strip()
            groups.setdefault(header + "\n" + (body[1] if len(body) > 1 else ""), []).append(name or module.name)
    if not groups:
        return "no Fp8Linear layers in this model"
    blocks = []
    for text, names in groups.items():
        header, rest = text.split("\n", 1)
        shown = names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} more with the same plan)"
        blocks.append(f"{shown}  {header}\n{rest}")
    return "\n\n".join(blocks)
