"""transformers' own generate (dynamic and static cache) and torch.compile with Fp8Linear layers."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import FORMATS

import fp8route.hf
from fp8route.engine import load_model

PROMPT = torch.tensor([[1, 17, 200, 45, 3, 99]])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return FORMATS["modelopt"](tmp_path_factory.mktemp("generate"))


@pytest.mark.parametrize("cache", [None, "static"])
def test_greedy_generate_matches_fp8routes_runner(folder, cache):
    model = fp8route.hf.from_pretrained(folder, dtype=torch.float32)
    kwargs = {} if cache is None else {"cache_implementation": cache}
    tokens = model.generate(PROMPT, max_new_tokens=6, do_sample=False, **kwargs)
    expected = load_model(folder, device="cpu", dtype=torch.float32).generate(PROMPT, 6)
    assert torch.equal(tokens, expected)


def test_no_graph_breaks_under_dynamo(folder):
    model = fp8route.hf.from_pretrained(folder, dtype=torch.float32)
    torch._dynamo.reset()
    report = torch._dynamo.explain(model)(PROMPT)
    assert report.graph_break_count == 0, [str(r.reason) for r in report.break_reasons]
    assert report.graph_count == 1


def test_compiled_forward_matches_eager(folder):
    # aot_eager traces through the custom ops without C++ codegen: inductor on a 2-core CPU is too slow here.
    model = fp8route.hf.from_pretrained(folder, dtype=torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(PROMPT).logits, model(PROMPT).logits)
