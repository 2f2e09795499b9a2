"""specjax.kernels: Pallas GPU kernels (with plain-jnp references) for probe scoring and
gathered attention over selected prefix KV, plus SPEC's ITF helpers."""

from specjax.kernels.common import IMPL_ENV_VAR, kernel_impl, online_softmax_step, resolve_impl
from specjax.kernels.gathered_attention import (
    attention_over_logits,
    gathered_attention,
    gathered_attention_pallas,
    gathered_attention_reference,
)
from specjax.kernels.itf import Identification, identify, itf_threshold, mean_pairwise_jaccard
from specjax.kernels.probe_scores import (
    probe_scores,
    probe_scores_pallas,
    probe_scores_reference,
)
from specjax.kernels.selections import BlockTable, PerHeadIndices, Selection, SharedIndices

__all__ = [
    "IMPL_ENV_VAR", "kernel_impl", "resolve_impl", "online_softmax_step",
    "probe_scores", "probe_scores_pallas", "probe_scores_reference",
    "gathered_attention", "gathered_attention_pallas", "gathered_attention_reference", "attention_over_logits",
    "SharedIndices", "PerHeadIndices", "BlockTable", "Selection",
    "Identification", "identify", "mean_pairwise_jaccard", "itf_threshold",
]
