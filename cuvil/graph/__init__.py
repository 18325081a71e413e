"""Whole-model compilation: the graph IR (``ir``) and the linker that turns many lowered kernels into one
native module with one entry point (``link``)."""
