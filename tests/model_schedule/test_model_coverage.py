"""A fixed sample of transformers architectures through the coverage checks of
:mod:`slapo.testing` (the whole sweep is ``benchmarks/model_coverage.py``).

A check may be ``"equal"`` or a typed ``"refused"``, never ``"different"`` (a schedule that
trains another model without saying so) nor an untyped ``"error"``. The architectures with a
ready schedule (llama, gpt2, qwen3) must be ``"equal"`` under it.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import check_all, run_workers
from slapo import testing as zoo

#: The single-process sample: three with ready schedules, three without.
SAMPLE = ("llama", "gpt2", "qwen3", "phi3", "gemma2", "olmo")
#: Architectures whose recommended schedule must give the unscheduled numbers.
READY = ("llama", "gpt2", "qwen3")
#: The TP=2 sample.
TP_SAMPLE = ("llama", "qwen3", "phi3")
ACCEPTED = ("equal", "refused")


def _explain(model_type: str, check: str, result: zoo.CheckResult) -> str:
    return f"{model_type} {check}: {result.status}: {result.detail} (max diff {result.max_diff})"


def test_causal_lm_types_sorted_and_complete() -> None:
    types = zoo.causal_lm_types()
    assert types == sorted(types)
    assert set(SAMPLE) <= set(types)


def test_tiny_config_is_small_and_deterministic() -> None:
    config = zoo.tiny_config("gpt2")
    assert (config.n_embd, config.n_layer, config.vocab_size) == (64, 2, 128)
    assert config.use_cache is False
    assert config.attn_pdrop == config.resid_pdrop == config.embd_pdrop == 0.0
    assert zoo.tiny_config("phi3").num_key_value_heads == 2


def test_tiny_config_unknown_type_is_typed() -> None:
    with pytest.raises(zoo.ZooError, match="no model type"):
        zoo.tiny_config("no-such-type")


def test_sample_batch_shapes_within_vocab() -> None:
    model = zoo.tiny_model("llama")
    batch = zoo.sample_batch(model, batch=3, seq=9)
    assert batch["input_ids"].shape == (3, 9)
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert 0 <= int(batch["input_ids"].min()) and int(batch["input_ids"].max()) < 128


def test_compare_grads_names_the_worst_parameter() -> None:
    want = {"a": torch.ones(3), "b": torch.ones(3)}
    got = {"a": torch.ones(3), "b": torch.tensor([1.0, 1.5, 1.0])}
    result = zoo.compare_grads(torch.tensor(1.0), torch.tensor(1.0), want, got)
    assert result.status == "different"
    assert "gradient of b" in result.detail and result.max_diff == pytest.approx(0.5)


#: Types that need their own tiny config (``TINY_OVERRIDES``), a sub-config's causal LM, or a
#: batch of another layout (MusicGen's codebooks, GIT's image).
OVERRIDDEN = ("roberta", "gpt_neo", "mamba2", "deepseek_v32", "blt", "musicgen", "git")


@pytest.mark.parametrize("model_type", OVERRIDDEN)
def test_overridden_types_train_eagerly(model_type: str) -> None:
    import transformers

    if _version(transformers.__version__) < _version(zoo.CONFIGS_WRITTEN_FOR):
        # the overrides name the config fields of the transformers they were written for
        pytest.skip(f"tiny configs written for transformers {zoo.CONFIGS_WRITTEN_FOR}")
    result = zoo.check_eager(model_type)
    assert result.status == "equal", _explain(model_type, "eager", result)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2])


def test_drafter_is_not_applicable() -> None:
    result = zoo.check_eager("gemma4_assistant")
    assert result.status == "n/a" and "drafter" in result.detail


@pytest.mark.parametrize("model_type", SAMPLE)
def test_eager(model_type: str) -> None:
    result = zoo.check_eager(model_type)
    assert result.status == "equal", _explain(model_type, "eager", result)


@pytest.mark.parametrize("model_type", SAMPLE)
def test_recommended_schedule(model_type: str) -> None:
    result = zoo.check_schedule(model_type)
    wanted = ("equal",) if model_type in READY else ACCEPTED
    assert result.status in wanted, _explain(model_type, "schedule", result)


@pytest.mark.parametrize("model_type", SAMPLE)
def test_trace_first_block(model_type: str) -> None:
    result = zoo.check_trace(model_type)
    assert result.status in ACCEPTED, _explain(model_type, "trace", result)


def tp_sample_job(rank: int, world: int) -> dict[str, dict]:
    """``check_tp`` of every type of :data:`TP_SAMPLE` on this rank (the ranks agree)."""
    group = torch.distributed.group.WORLD
    return {t: zoo.check_tp(t, group).as_dict() for t in TP_SAMPLE}


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_tensor_parallel_sample() -> None:
    ranks = check_all(run_workers(tp_sample_job, 2, timeout=60.0, deadline=120.0))
    assert ranks[0] == ranks[1], "the ranks disagree"
    failures = [
        _explain(t, "TP=2", zoo.CheckResult.from_dict(doc))
        for t, doc in ranks[0].items()
        if doc["status"] not in ACCEPTED
    ]
    assert not failures, "\n".join(failures)
