"""Checkpoint folders: read (shards, formats, layout -> Fp8Linear layers; plain float folders as
tensors), written (quantize, calibration, over the model definition) and converted (GGUF)."""
