"""Lay a run's systems beside an earlier run's on the same requests:
python drivers/merge.py OLD NEW OUT [--drop S,...] [--rename S=T,...]

OLD and NEW are one task's output folders (requests.jsonl, results.json) of `python -m specjax.eval` with the same
task, items, prefixes and seed; OUT gets OLD's systems (less NEW's and --drop's) and NEW's, in both files. Refused
unless every request of NEW is the request of OLD with its id: the same prefix, item and gold answer, and the same
number of requests. --rename gives OLD's system S the name T (a system whose name has since come to mean another)."""

import argparse
import json
import pathlib


def rows(folder: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines()]


def requests(rs: list[dict]) -> dict[int, tuple]:
    return {r["request_id"]: (r["prefix_id"], r["doc_index"], r["gold"]) for r in rs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("old", type=pathlib.Path)
    ap.add_argument("new", type=pathlib.Path)
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--drop", default="", help="OLD's systems left out, comma-separated")
    ap.add_argument("--rename", default="", help="OLD's systems renamed, S=T comma-separated")
    args = ap.parse_args()
    renamed = dict(pair.split("=", 1) for pair in filter(None, args.rename.split(",")))
    old, new = [dict(r, system=renamed.get(r["system"], r["system"])) for r in rows(args.old)], rows(args.new)
    new_systems = {r["system"] for r in new}
    gone = new_systems | set(filter(None, args.drop.split(",")))
    for system in {r["system"] for r in old}:
        mine = requests([r for r in old if r["system"] == system])
        for other in new_systems:
            theirs = requests([r for r in new if r["system"] == other])
            if mine != theirs:
                raise SystemExit(f"{args.new}'s {other} ran other requests than {args.old}'s {system}")
    old_results = json.loads((args.old / "results.json").read_text())
    new_results = json.loads((args.new / "results.json").read_text())
    systems = {renamed.get(k, k): v for k, v in old_results["systems"].items() if renamed.get(k, k) not in gone}
    systems.update(new_results["systems"])
    args.out.mkdir(parents=True, exist_ok=True)
    kept = [r for r in old if r["system"] not in gone] + new
    (args.out / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    merged = {**old_results, "systems": systems,
              "merged": {"old": str(args.old), "new": str(args.new), "new_systems": sorted(new_systems),
                         "dropped": sorted(gone - new_systems), "renamed": renamed,
                         "new_command": new_results.get("command"),
                         "new_code": new_results.get("code")}}
    (args.out / "results.json").write_text(json.dumps(merged, indent=1))
    print(f"{args.out}: {len(kept)} requests of {len({r['system'] for r in kept})} systems")


if __name__ == "__main__":
    main()
