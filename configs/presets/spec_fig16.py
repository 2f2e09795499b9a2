"""SPEC (paper 000) Fig. 16 / 17: average TTFT and I/O time of SPEC and its baselines.

Setup (section VI-A/B): PIQA, RTE, COPA, OpenBookQA; 2-10 few-shot examples per shared system
prompt, reuse frequency normal; prefixes extended to 4.8k-5.7k tokens on average (max 10k);
64-token chunks; retention 25% (COPA 50%); caches pre-warmed. The paper's 10 GB GPU and 32 GB
CPU caches against 55-65 GB of prefix KV are about 16% and 52% of the store: budgets are
given as those fractions so they scale with the model (and part of the KV lives only on disk).
"""

PRESET = {
    "description": "SPEC Fig. 16: TTFT of recompute, AS-like, AS+H2O+LRU/LFU and SPEC",
    "tasks": ["piqa", "rte", "copa", "openbookqa"],
    "flags": {
        "systems": "recompute,as_full,as_h2o_lru,as_h2o_lfu,spec",
        "retention": "0.25",
        "chunk_tokens": 64,
        "num_fewshot": "2-10",
        "prefix_tokens": 5000,
        "gpu_cache": "16%",
        "cpu_cache": "52%",
        "disk_bandwidth": "5GB/s",
    },
    "per_task": {"copa": {"retention": "0.5"}},
}
