"""Test support for mhc-megatron, kept in the repository and out of the installed package.

CPU shims that let Megatron-Core run without CUDA (``cpu``, ``cpu_training``), a CPU
stand-in for MLA's core attention (``attention``) and the third-party warning filters the
tests and the demo share (``warning_filters``). The tests, the demo and the benchmarks import
it from the repository root; a GPU training job never does.
"""
