"""The runtime: what one ``forward``/``forward_backward`` does.

Modules: ``run`` (the round-robin run of stages and microbatches, recompute), ``plan``
(:class:`~roundpipe.ModelExecutePlan` and the partitioner; the seed's ``roundpipe.scheduler``),
``run_config``, ``batch`` (microbatch split and merge, :class:`~roundpipe.RoundPipePackedData`),
``split_spec``, ``context`` (forward/recompute/optimizer contexts, ``save_for_recompute``),
``timer``, ``profile``, ``rng``.
"""
