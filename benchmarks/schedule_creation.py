"""How long scheduling a meta-device Llama-7B takes: create_schedule plus 32 checkpoint() calls.

Run: .venv/bin/python benchmarks/schedule_creation.py
"""

from __future__ import annotations

import time

import transformers

import slapo


def main() -> None:
    config = transformers.LlamaConfig(  # Llama-2-7B's shape
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    )
    t0 = time.perf_counter()
    with slapo.init_empty_weights():
        model = transformers.LlamaForCausalLM(config)
    t1 = time.perf_counter()
    sch = slapo.create_schedule(model)
    t2 = time.perf_counter()
    for i in range(config.num_hidden_layers):
        sch[f"model.layers.{i}"].checkpoint()
    t3 = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: Llama-7B config on the meta device, {params / 1e9:.2f}B parameters")
    print(f"{'step':<34}{'seconds':>10}")
    print(f"{'build the meta model':<34}{t1 - t0:>10.3f}")
    print(f"{'create_schedule':<34}{t2 - t1:>10.4f}")
    print(f"{'32 x checkpoint()':<34}{t3 - t2:>10.4f}")
    print(f"{'create_schedule + checkpoints':<34}{t3 - t1:>10.4f}")
    print(f"schedules in the tree: {sum(1 for _ in sch.named_schedules())}")


if __name__ == "__main__":
    main()
