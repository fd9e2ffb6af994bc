"""The model wrappers: :class:`~roundpipe.RoundPipe` around a sequence of layers and
:func:`~roundpipe.wrap_model_to_roundpipe`, which cuts a model into layers (a preset from
:mod:`roundpipe.models`, or by size).

Modules: ``model`` (RoundPipeBase, RoundPipe, AutoRoundPipe; the seed's ``roundpipe.roundpipe``),
``wrap`` (``roundpipe.wrapper``), ``sizes`` (``roundpipe.utils``). The layer and parameter
attributes they attach live one floor down, in :mod:`roundpipe.devices.attribute`.
"""
