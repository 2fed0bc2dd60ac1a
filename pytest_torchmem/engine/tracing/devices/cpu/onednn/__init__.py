"""oneDNN's CPU convolution primitives, as the CPU rules model them.

What a CPU convolution takes from the allocator depends, once ATen has chosen
oneDNN (``cpu/conv.py``), on the primitive implementation oneDNN picks and on
its blocking: oneDNN chooses the memory formats, so ideep reorders the source,
the weights and the incoming gradient into them, allocates the result in its
format, books the primitive's scratchpad, and ``mkldnn_to_dense`` copies the
result into a dense tensor. The modules follow oneDNN v3.12 (commit 80afa71,
the one torch 2.13 bundles), implementation by implementation
(``src/cpu/cpu_convolution_list.cpp`` and each implementation's
``init_conf``/``init_scratchpad``), for the modelled CPU's ISA level and
thread count (:class:`~pytest_torchmem.engine.tracing.devices.cpu.profiles.CpuProfile`).
A booking of ``n`` bytes costs ``n`` plus its alignment (128 bytes; 4096 for
page-aligned buffers and for barriers).
"""
