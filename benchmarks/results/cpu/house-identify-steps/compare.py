"""Side by side: two trees' results of the same evaluations (accuracy, bytes, TTFT, every request's log-probabilities).

    python benchmarks/results/cpu/house-identify-steps/compare.py BASE_DIR NEW_DIR TASK_FOLDER...
"""

import json
import pathlib
import sys


def load(folder: pathlib.Path):
    results = json.loads((folder / "results.json").read_text())
    rows = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines() if line]
    return results["systems"], {(r["system"], r["request_id"]): r["choice_logprobs"] for r in rows}


def main(base: str, new: str, *folders: str) -> None:
    print("| run | system | accuracy base / new | disk bytes base / new | host-to-device bytes base / new | "
          "TTFT ms base / new |")
    print("|---|---|---|---|---|---|")
    for folder in folders:
        (b, b_lp), (n, n_lp) = load(pathlib.Path(base) / folder), load(pathlib.Path(new) / folder)
        for key in b:
            sb, sn = b[key], n[key]
            bytes_b, bytes_n = sb["io"]["disk_bytes"], sn["io"]["disk_bytes"]
            h2d_b, h2d_n = sb["io"]["host_to_device_bytes"], sn["io"]["host_to_device_bytes"]
            print(f"| {folder} | {key} | {100 * sb['accuracy']['acc']:.2f} / {100 * sn['accuracy']['acc']:.2f}% | "
                  f"{bytes_b:,} / {'same' if bytes_n == bytes_b else f'{bytes_n:,}'} | "
                  f"{h2d_b:,} / {'same' if h2d_n == h2d_b else f'{h2d_n:,}'} | "
                  f"{sb['ttft_ms']['mean']:.1f} / {sn['ttft_ms']['mean']:.1f} |")
        same = sum(b_lp[k] == n_lp.get(k) for k in b_lp)
        print(f"\n{folder}: {same} of {len(b_lp)} requests' choice log-probabilities identical\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
