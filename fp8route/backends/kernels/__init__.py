"""fp8route's own Triton kernels: the activation quantizer and the decode GEMM.

Nothing here imports triton at module level except through `triton_support`, so a CPU-only install
imports these modules and learns from TRITON_IMPORT_ERROR why they cannot run.
"""
