"""Mean TTFT of as_h2o_lfu and spec_gqa in every run folder under the argument, their ratio, and spec_gqa's reads,
bytes and breakdown."""
import glob
import json
import os
import sys

for d in sorted(glob.glob(sys.argv[1] + '/*/results.json')):
    name = os.path.basename(os.path.dirname(d))
    s = json.load(open(d))['systems']
    a, b = s['as_h2o_lfu'], s['spec_gqa']
    print(f"{name:10s} h2o {a['ttft_ms']['mean']:7.1f} spec_gqa {b['ttft_ms']['mean']:7.1f} "
          f"ratio {b['ttft_ms']['mean'] / a['ttft_ms']['mean']:.3f}  cpu {a.get('cpu_ms', 0):.0f}/{b.get('cpu_ms', 0):.0f} "
          f"reads {b['io']['read_requests_per_request']:.1f} bytes {b['io']['disk_bytes']} "
          f"acc {b['accuracy']['acc']} {a['accuracy']['acc']}  bd "
          + ' '.join(f"{k}={v:.0f}" for k, v in b['breakdown_ms'].items()))
