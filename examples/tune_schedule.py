"""A tuning space over the ready schedule's knobs, for ``slapo tune`` on ``slapo train``.

    slapo tune --config examples/tune_schedule.py --db schedule.json --budget 8 \
        -- slapo train --model gpt2 --steps 20 --baseline-steps 0 --no-sample --no-progress --json

Each trial runs ``slapo train ... --ckpt-ratio R --ckpt-policy P --compile-model C --attn-op A ...``
(the knobs that apply to ``--model``; ``--tp``/``--nproc`` add sequence_parallel and num_stages)
and reads its last JSON line, ``{"throughput": tokens/s, ...}``. ``--baseline-steps 0
--no-sample``: a trial needs neither the eager baseline nor the text at the end.
"""

from slapo.tune.schedule_space import update_space  # noqa: F401  (slapo tune calls update_space)
