"""as_full and as_h2o_lfu in alternating benchmarks/data_path.py runs of two trees: TTFT, host time nothing
overlapped, CPU time to the first token, and the disk rate and device floor of each run."""
import glob
import json
import os
import sys

for f in sorted(glob.glob(sys.argv[1] + "/*.json"), key=lambda p: (os.path.basename(p)[-6:], p)):
    r = json.load(open(f))
    row = [os.path.basename(f)[:-5], f"disk {r['disk']['disk_GBps']:.2f} GB/s", f"floor {r['device_floor_ms']:.0f}"]
    for name, s in r["systems"].items():
        row.append(f"{name} {s['ttft_ms']:.1f} ms (host {s['host_exposed_ms']:.1f}, CPU {s['cpu_ms']:.0f}, "
                   f"sum-ratio {s['ttft_over_bytes_plus_device_ms']:.2f})" if "ttft_over_bytes_plus_device_ms" in s
                   else f"{name} {s['ttft_ms']:.1f} ms (host {s['host_exposed_ms']:.1f}, CPU {s['cpu_ms']:.0f})")
    print("  ".join(row))
