"""Devices and the links to them: the device manager (CUDA, or CPU virtual devices), the
host-device link and its copy engines, parameter and gradient transfer, pinned host memory, the
runtime's threads with their timeouts, and the per-layer and per-parameter attributes that order
device, main and optimizer threads.

Modules: ``device``, ``link``, ``transfer``, ``pinning`` (the seed's ``roundpipe.memory``),
``threads``, ``units``, ``attribute`` (the seed's ``roundpipe.attribute``).
"""
