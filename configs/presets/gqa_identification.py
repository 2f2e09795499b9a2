"""Grouped-query-aware identification against exact per-head H2O and SPEC's ITF.

PIQA, COPA, OpenBookQA and RTE with the eval's default prefixes (2-10 few-shot examples), 600 items in all, at 25%
retention (override with --retention 0.1 or 0.5); every system on the same requests, so accuracy is paired per item
(`benchmarks/pooled_accuracy.py DIR` pools the four tasks).
"""

PRESET = {
    "description": "spec_gqa vs as_h2o_lfu and spec on four multiple-choice tasks",
    "tasks": ["piqa", "copa", "openbookqa", "rte"],
    "flags": {
        "systems": "as_h2o_lfu,spec,spec_gqa",
        "retention": "0.25",
    },
    "per_task": {
        "piqa": {"limit": 200},
        "copa": {"limit": 100},
        "openbookqa": {"limit": 200},
        "rte": {"limit": 100},
    },
}
