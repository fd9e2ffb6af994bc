"""A tuning space over the ready schedule's knobs, for ``slapo tune`` on ``slapo train``.

    slapo tune --config examples/tune_schedule.py --db schedule.json --budget 8 \
        -- slapo train --model gpt2 --steps 20 --no-progress --json

Each trial runs ``slapo train ... --ckpt-ratio R --attn-op A --fuse-ops F --fused-loss L`` (the
knobs that apply to ``--model``; ``--tp``/``--nproc`` add sequence_parallel and num_stages) and
reads its last JSON line, ``{"throughput": tokens/s, ...}``.
"""

from slapo.model_schedule import update_space  # noqa: F401  (slapo tune calls update_space)
