"""fp8route's Triton kernels that are not GEMMs, importable without the engine.

Each module holds one kernel family, its launch and its torch reference. Nothing here imports
triton at module level except through `fp8route.backends.kernels.triton_support`, so a CPU-only
install imports these modules and learns from TRITON_IMPORT_ERROR why they cannot run.
"""
