"""Hugging Face transformers integration (`pip install fp8route[transformers]`).

`from_pretrained(path)` loads an FP8 folder (ModelOpt, compressed-tensors or quant_method fp8; per
tensor, per channel or in 128x128 blocks) as a transformers
model whose linears are fp8route.Fp8Linear; importing this package also registers fp8route's
quantizer with transformers, so `AutoModelForCausalLM.from_pretrained(path)` does the same for a
ModelOpt config.json checkpoint and `quantization_config=Fp8RouteConfig()` selects it for any.
`quantize_model` turns a float transformers model into one with calibrated static FP8 linears and
`save_pretrained` writes it as a ModelOpt FP8 checkpoint. Only this package imports transformers.
"""

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only where transformers is missing
    raise ImportError("fp8route.hf needs Hugging Face transformers: pip install 'fp8route[transformers]'") from e

from fp8route.hf.config import REGISTERED_METHODS, Fp8RouteConfig
from fp8route.hf.load import from_pretrained
from fp8route.hf.quantize import quantize_model
from fp8route.hf.quantizer import Fp8RouteHfQuantizer
from fp8route.hf.save import save_pretrained

__all__ = [
    "REGISTERED_METHODS",
    "Fp8RouteConfig",
    "Fp8RouteHfQuantizer",
    "from_pretrained",
    "quantize_model",
    "save_pretrained",
]
