import os, time, tempfile, concurrent.futures, numpy as np, sys
n_threads, batch = int(sys.argv[1]), int(sys.argv[2])
path = tempfile.mktemp()
with open(path, "wb") as f: f.write(np.random.default_rng(0).bytes(256 << 20))
pool = concurrent.futures.ThreadPoolExecutor(n_threads)
N = 3584
def rd(offs):
    fd = os.open(path, os.O_RDONLY)
    try:
        out = []
        for off in offs:
            buf = bytearray(32768); os.preadv(fd, [buf], off); out.append(buf)
    finally:
        os.close(fd)
    return out
for rep in range(3):
    offs = [i * 65536 for i in range(N)]
    t = time.perf_counter()
    futs = [pool.submit(rd, offs[i:i + batch]) for i in range(0, N, batch)]
    concurrent.futures.wait(futs)
    dt = time.perf_counter() - t
print(f"threads {n_threads}, {batch} reads a task: {dt/N*1e6:.1f} us/read")
os.remove(path)
