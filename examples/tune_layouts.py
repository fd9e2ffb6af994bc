"""A tuning space over layouts, for ``slapo tune`` on ``slapo train``: tensor, pipeline and data
parallel sizes, the pipeline's microbatches and schedule.

    slapo tune --config examples/tune_layouts.py --db layouts.json --memory-budget 32MiB \
        -- slapo train --model llama --steps 20 --baseline-steps 0 --no-sample --no-progress --json

Each trial runs on dp * tp * pp processes, launched by the tuner:
``python -m torch.distributed.run --nproc-per-node 4 --master-port PORT -m slapo train ... --tp 2
--pp 2`` (``dp`` is the launcher's process count, not a flag). ``--memory-budget`` skips, before any
trial, the layouts whose busiest rank is estimated over the budget; ``--dry-run`` lists them all.
"""

#: The most processes a layout may take (dp * tp * pp): the devices (or cores) of the machine.
MAX_PROCS = 4


def update_space(args, space):
    """``args`` holds the training command's flags (``args.batch_size``: what microbatches split)."""
    batch_size = int(args.get("batch_size", 8))  # slapo train's default batch size
    tp = space.create_symbol("tp", [1, 2])
    pp = space.create_symbol("pp", [1, 2])
    # A dependent symbol is the constraint: the replicas take the processes left (tp*pp*dp <= 4).
    space.create_symbol("dp", [d for d in (1, 2) if tp.value * pp.value * d <= MAX_PROCS])
    if pp.value > 1:  # the pipeline's knobs exist only for a pipeline
        # 1F1B needs a microbatch per stage at least; each microbatch takes a slice of the batch.
        micro = [m for m in (2, 4) if m >= pp.value and batch_size % m == 0]
        space.create_symbol("num_microbatches", micro)
        space.create_symbol("pipeline_schedule", ["1F1B", "GPipe"])
    return space
