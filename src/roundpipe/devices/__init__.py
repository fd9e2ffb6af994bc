"""Devices and the links to them: the device manager (CUDA, or CPU virtual devices), the
host-device link and its copy engines, parameter and gradient transfer, pinned host memory, and
the runtime's threads with their timeouts.

Modules: ``device``, ``link``, ``transfer``, ``pinning`` (the seed's ``roundpipe.memory``),
``threads``, ``units``.
"""
