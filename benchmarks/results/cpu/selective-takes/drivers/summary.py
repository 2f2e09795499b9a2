import json, sys
r = json.load(open(sys.argv[1] + "/results.json"))
full = r["systems"].get("as_full")
ft = full["ttft_ms"]["mean"] if full else None
fh = full["counters"]["host_to_device_bytes"] if full else None
for k, s in r["systems"].items():
    c = s["counters"]; t = s["ttft_ms"]["mean"]
    h2d, used, pages = c["host_to_device_bytes"], c["used_token_bytes"], c.get("device_page_bytes", 0)
    line = f"{k:12s} ttft {t:8.1f}  h2d/used {h2d/used:5.2f}  pages/h2d {pages/h2d:5.2f}  exposed {s['host_exposed_ms']:6.1f} ({s['host_exposed_ms']/t*100:4.1f}%)  compiles {s['compilations_timed']}  bd {{{', '.join(f'{a}:{b:.0f}' for a,b in s['breakdown_ms'].items())}}}"
    if ft: line += f"  ttft/full {t/ft:5.3f}  h2d/full {h2d/fh:5.3f}  bar(b) {t/(1.15*h2d/fh*ft):5.2f}"
    line += f" disk {c['disk_bytes']/2**20:.0f}MiB"
    print(line)
