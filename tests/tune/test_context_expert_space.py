"""Context and expert parallelism in the tuning space: cp takes processes (dp * pp * cp * tp), ep
borrows them from dp x cp; the knobs a cp layout cannot change stay out of its configurations;
the memory budget estimates a cp/ep trial per rank."""

from __future__ import annotations

import sys

from slapo.train.train_cli import train_estimator
from slapo.tune import Space
from slapo.tune.launch import expert_sizes, launch_argv, layout_processes
from slapo.tune.schedule_space import CONTEXT_PARALLEL_FIXED, layout_space, tuning_space


def test_cp_takes_processes_and_stays_a_flag():
    assert layout_processes({"dp": 2, "cp": 2, "tp": 2}) == 8
    assert layout_processes({"dp": 2, "ep": 2}) == 2  # ep borrows dp's ranks
    assert layout_processes({"dp": 2}, ["slapo", "train", "--cp", "2"]) == 4
    argv = launch_argv(["slapo", "train"], {"dp": 2, "cp": 2, "ep": 4}, port=29511)
    assert argv[:5] == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"]
    assert argv[-6:] == ["slapo", "train", "--cp", "2", "--ep", "4"]


def test_expert_sizes_divide_dp_times_cp_in_multiples_of_cp():
    assert expert_sizes(4) == [1, 2, 4]
    assert expert_sizes(2, cp=2) == [1, 2, 4]
    assert expert_sizes(3, cp=2) == [1, 2, 6]
    assert expert_sizes(4, cp=1, num_experts=6) == [1, 2]


def test_the_layout_space_holds_only_layouts_slapo_train_runs():
    configs = list(Space(lambda args, s: layout_space(s, 8, num_experts=8)))
    assert configs and len({tuple(sorted(c.items())) for c in configs}) == len(configs)
    for c in configs:
        assert c["dp"] * c["pp"] * c["cp"] * c["tp"] <= 8
        assert c["cp"] == 1 or c["pp"] == 1  # cp inside pipeline stages is not wired
        assert c["ep"] in expert_sizes(c["dp"], c["cp"], 8)
        assert c["ep"] == 1 or c["tp"] == 1  # tp would shard the experts ep splits
    assert {c["cp"] for c in configs} == {1, 2}
    assert {c["ep"] for c in configs} == {1, 2, 4, 8}
    assert {"cp": 2, "dp": 2, "ep": 4, "tp": 1, "pp": 1} in configs


def test_a_cp_layout_keeps_the_attention_and_loss_knobs_at_their_defaults():
    def update(args, space):
        return tuning_space(layout_space(space, 2, tp=[1], pp=[1]), "llama", world_size=2)

    configs = list(Space(update))
    with_cp = [c for c in configs if c["cp"] == 2]
    without = [c for c in configs if c["cp"] == 1]
    assert with_cp and without
    assert all(not set(CONTEXT_PARALLEL_FIXED) & set(c) for c in with_cp)
    assert all(set(CONTEXT_PARALLEL_FIXED) <= set(c) for c in without)


def test_the_memory_budget_estimates_a_cp_ep_trial_per_rank():
    estimate = train_estimator(["slapo", "train", "--model", "qwen3_moe", "--seq-len", "64"])
    one = estimate({"dp": 2})
    split = estimate({"dp": 1, "cp": 2, "ep": 2})
    assert split.layout == {"dp": 1, "pp": 1, "tp": 1, "cp": 2, "ep": 2}
    assert split.activations < one.activations and split.params < one.params
