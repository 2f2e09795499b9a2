"""Accuracy vs retention on the synthetic needle task (answers only in the prefix)."""

PRESET = {
    "description": "needle: accuracy of the retention-based systems at 5-50% retention vs recompute",
    "tasks": ["needle"],
    "flags": {
        "systems": "recompute,as_h2o_lru,impress,spec",
        "retention": "0.05,0.1,0.25,0.5",
    },
}
