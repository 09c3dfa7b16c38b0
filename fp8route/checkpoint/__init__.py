"""Per-tensor FP8 checkpoints: read (shards, formats, layout -> Fp8Linear layers), written
(quantize, calibration) and converted (GGUF)."""
