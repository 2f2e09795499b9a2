"""Where a run's host time holding the GIL goes, per request, from a py-spy profile of an evaluation.

    py-spy record --nonblocking --gil --format raw --rate 100 -o gqa.txt -- \
        python -m specjax.eval --task piqa --data_dir DATA --limit 24 --prefix_tokens 1024 \
        --systems spec_gqa --retention 0.25 --progress=false --output_dir /tmp/gqa
    python benchmarks/gil_profile.py gqa.txt --requests 24 --rate 100

`--gil` samples only the thread holding the GIL, so a frame's samples are host time that no other Python thread could
use. Two tables. The request's own thread during the timed requests: stacks through `--timed_frame`, the runner's
timed loop, which runs each request to its end, so the work after its first token is in it too. Every other thread over
the whole run, warm-up included: read completion, the read plan, speculation, store writes. Both by frame: a frame
counts once per sample, so nested frames overlap; the trunk every sample shares is left out. Milliseconds per request
= samples / rate / requests. py-spy needs to be installed (`pip install py-spy`; not a dependency of specjax).
"""

from __future__ import annotations

import argparse
import collections
import gzip


def stacks(path: str) -> list[tuple[list[str], int]]:
    """py-spy's raw format (gzipped if it ends in .gz): one `frame;frame;... count` line per distinct stack, outermost
    frame first."""
    out = []
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            out.append((stack.split(";"), int(count)))
    return out


def frame_name(frame: str) -> str:
    """`fn (path/to/file.py:line)` -> `fn file.py:line`."""
    name, _, where = frame.partition(" (")
    return f"{name} {where.rstrip(')').rsplit('/', 1)[-1]}" if where else name


def inclusive(rows, skip: int = 0) -> collections.Counter:
    """Samples per frame, each frame once per stack (frames after the first `skip`)."""
    counts = collections.Counter()
    for frames, n in rows:
        for name in {frame_name(f) for f in frames[skip:]}:
            counts[name] += n
    return counts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/gil_profile.py", description=__doc__.splitlines()[0])
    parser.add_argument("raw", help="py-spy record --format raw output (or it gzipped)")
    parser.add_argument("--requests", type=int, required=True, help="timed requests in the run (--limit)")
    parser.add_argument("--rate", type=float, default=100.0, help="py-spy's --rate")
    parser.add_argument("--timed_frame", default="runner.py:151", help="a frame only timed requests pass through")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    rows = stacks(args.raw)
    ms = 1e3 / args.rate / args.requests
    timed = [(f, n) for f, n in rows if any(args.timed_frame in x for x in f)]
    others = [(f, n) for f, n in rows if f and f[0].startswith("Thread._bootstrap")]
    for title, part in (("request thread, timed requests", timed), ("other threads, whole run", others)):
        total = sum(n for _, n in part)
        print(f"\n{title}: {total} samples, {total * ms:.1f} ms per request")
        ranked = sorted(inclusive(part).items(), key=lambda item: (-item[1], item[0]))
        below = [(name, n) for name, n in ranked if n < total]  # not the trunk every sample shares
        for name, n in below[: args.top]:
            print(f"  {n * ms:8.1f} ms  {name}")


if __name__ == "__main__":
    main()
