"""The model wrappers: :class:`~roundpipe.RoundPipe` around a sequence of layers, the layer and
parameter attributes that synchronise host, device and optimizer, and
:func:`~roundpipe.wrap_model_to_roundpipe`, which cuts a model into layers (a preset from
:mod:`roundpipe.models`, or by size).

Modules: ``model`` (RoundPipeBase, RoundPipe, AutoRoundPipe; the seed's ``roundpipe.roundpipe``),
``wrap`` (``roundpipe.wrapper``), ``attribute``, ``sizes`` (``roundpipe.utils``).
"""
