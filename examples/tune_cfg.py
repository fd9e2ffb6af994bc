"""A tuning space for ``slapo tune``: batch size, sequence length and checkpointing.

    slapo tune --config examples/tune_cfg.py --db results.json --strategy bayes --budget 12 \
        -- python my_train.py --gpus 2

Each trial runs ``python my_train.py --gpus 2 --batch-size B --seq-len S --ckpt-ratio R``; the
script must print its result as its last JSON line, e.g. ``{"throughput": 1234.5}``.
"""


def update_space(args, space):
    """``args`` holds the training command's flags (``args.gpus == 2`` above)."""
    gpus = args.get("gpus", 1)
    batch = space.create_symbol("batch_size", [4, 8, 16, 32])
    # Dependent symbol: keep the tokens per device bounded, so the candidates for the
    # sequence length depend on the batch size chosen above.
    space.create_symbol("seq_len", [s for s in (256, 512, 1024) if batch.value * s <= 16384 * gpus])
    space.create_symbol("ckpt_ratio", [0.0, 0.5, 1.0])
    return space
