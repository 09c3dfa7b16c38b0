"""Measurement: the tuner that makes routing tables, timing with cold L2, the workloads it times,
the ceilings floors come from, and the GEMM benchmark's report and plots."""
