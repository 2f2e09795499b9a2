"""ContiguousKV (paper 003) Fig. 10: average TTFT at 5% and 25% KV budget ratios.

Setup (section 5.1, Table 1): SST-2, SUBJ, TREC, RTE; few-shot examples sampled from each
class of the training set; prefixes of 100 / 110 / 120 / 80 examples (3.8k / 4.4k / 5k / 6k
tokens); seed 42; 64-token chunks for the AS and IMPRESS baselines (ContiguousKV itself uses
16-token chunks); 10 GB GPU and 24 GB CPU memory against ~67-75 GB of prefix KV (Qwen2.5-7B),
i.e. about 15% and 35% of the store.
"""

PRESET = {
    "description": "ContiguousKV Fig. 10: TTFT of AS+LRU, AS+H2O+LFU, IMPRESS and ContiguousKV",
    "tasks": ["sst2", "subj", "trec", "rte"],
    "flags": {
        "systems": "recompute,as_full,as_h2o_lfu,impress,contiguous_kv",
        "retention": "0.05,0.25",
        "chunk_tokens": 64,
        "seed": 42,
        "gpu_cache": "15%",
        "cpu_cache": "35%",
    },
    "per_task": {
        "sst2": {"num_fewshot": "100", "prefix_tokens": 3800},
        "subj": {"num_fewshot": "110", "prefix_tokens": 4400},
        "trec": {"num_fewshot": "120", "prefix_tokens": 5000},
        "rte": {"num_fewshot": "80", "prefix_tokens": 6000},
    },
}
