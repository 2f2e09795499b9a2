"""TTFT of the two trees' turns (`drivers/ab_ttft.sh`): each system's mean TTFT per run, and new / base per round.

    python benchmarks/results/cpu/policies-connector-sample/ab_compare.py OUT ROUNDS
"""

import json
import pathlib
import sys


def ttfts(folder: pathlib.Path) -> dict:
    systems = json.loads((folder / "results.json").read_text())["systems"]
    return {name: s["ttft_ms"]["mean"] for name, s in systems.items()}


def main(out: str, rounds: int) -> None:
    runs = {(tree, r): ttfts(pathlib.Path(out) / f"{tree}-{r}")
            for r in range(1, rounds + 1) for tree in ("base", "new")}
    systems = list(runs["base", 1])
    print("| system | " + " | ".join(f"base {r} / new {r} ms (new / base)" for r in range(1, rounds + 1)) + " |")
    print("|---|" + "---|" * rounds)
    for name in systems:
        cells = []
        for r in range(1, rounds + 1):
            base, new = runs["base", r][name], runs["new", r][name]
            cells.append(f"{base:.1f} / {new:.1f} ({new / base:.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
