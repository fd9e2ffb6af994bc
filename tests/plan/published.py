"""Published training runs and formulas the plan is checked against (issue 37), with citations.

No network here: every figure below was transcribed from the papers named, not re-checked
against them by the test run. Only figures the transcriber was sure of are listed.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
#: (arXiv 2205.05198), Table 3: the GPT shapes they measure, (heads, hidden, layers); sequence
#: 2048, vocabulary 51200, tensor parallel 8 in every row.
KORTHIKANTI_SHAPES: dict[str, tuple[int, int, int]] = {
    "22B": (64, 6144, 48),
    "175B": (96, 12288, 96),
    "530B": (128, 20480, 105),
    "1T": (160, 25600, 128),
}
KORTHIKANTI_SEQ, KORTHIKANTI_TP = 2048, 8


def korthikanti_per_layer(layout: str, *, s: int, h: int, a: int, t: int) -> float:
    """Bytes per ``s*b*h`` one GPT layer keeps for backward in 16-bit, by Korthikanti et al.
    2022 (Section 4, Table 2): 1-byte dropout masks, the attention scores materialised.

    ``layout``: ``none`` (no parallelism), ``tp`` (tensor parallel over ``t``), ``tp+sp`` (and
    sequence parallel), ``selective+sp`` (attention core recomputed, sequence parallel),
    ``selective`` (attention core recomputed, no tensor parallelism: ``t`` is 1), ``full``
    (every layer recomputed: its input only).

    Example:
        >>> korthikanti_per_layer("tp+sp", s=2048, h=12288, a=96, t=8)
        14.25
    """
    r = 5 * a * s / h
    return {
        "none": 34 + r,
        "tp": 10 + 24 / t + r / t,
        "tp+sp": (34 + r) / t,
        "selective": 34.0,
        "selective+sp": 34 / t,
        "full": 2.0,
    }[layout]


@dataclass(frozen=True)
class MegatronRun:
    """One row of Narayanan et al. 2021, Table 1 (GPT on A100 80 GB, fp16, full recompute)."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int  # global batch, sequences
    tflops_per_gpu: float  # achieved, as the paper counts FLOPs (recomputation included)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def flops_per_token(self) -> float:
        """The paper's FLOPs of one iteration, ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``
        (with recomputation), per token."""
        h, lay, s, v = self.hidden, self.layers, MEGATRON_SEQ, MEGATRON_VOCAB
        return 96 * lay * h * h * (1 + s / (6 * h) + v / (16 * lay * h))

    def tokens_per_s_per_gpu(self) -> float:
        """The published throughput as tokens/s per GPU."""
        return self.tflops_per_gpu * 1e12 / self.flops_per_token()


#: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
#: Megatron-LM" (SC21, arXiv 2104.04473), Table 1 (weak scaling), the rows checked here:
#: heads, hidden, layers, tensor/pipeline parallel sizes, GPUs, global batch, achieved
#: TFLOP/s per GPU. Sequence 2048, vocabulary 51200, fp16, full activation recomputation,
#: Selene (DGX A100 80 GB: 8 GPUs per node on NVSwitch, eight 200 Gb/s HDR InfiniBand HCAs
#: per node: one per GPU). Transcribed from the paper (no network here to re-check); each
#: row's TFLOP/s x GPUs agrees with its published aggregate PFLOP/s.
MEGATRON_SEQ, MEGATRON_VOCAB = 2048, 51200
MEGATRON_TABLE1 = [
    MegatronRun("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    MegatronRun("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    MegatronRun("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    MegatronRun("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
