"""One 4 MiB O_DIRECT read against the same 4 MiB split into 1 MiB, 512 KiB or 256 KiB reads issued at once on 16
threads, second reads of a 256 MiB scratch file (read whole once first); median and 10th percentile of 30."""
import concurrent.futures as cf
import mmap
import os
import time

path = '/tmp/dp/scratch.bin'
N = 256 << 20
if not os.path.exists(path):
    with open(path, 'wb') as f:
        f.write(os.urandom(N))
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
whole = mmap.mmap(-1, 4 << 20)
whole.write(b'\1' * len(whole))
pool = cf.ThreadPoolExecutor(16)
for off in range(0, N, 4 << 20):
    os.preadv(fd, [whole], off)
for piece in (4 << 20, 1 << 20, 512 << 10, 256 << 10):
    bufs = [mmap.mmap(-1, piece) for _ in range((4 << 20) // piece)]
    ts = []
    for rep in range(30):
        off = (rep * (4 << 20)) % N
        t = time.perf_counter()
        if piece == 4 << 20:
            os.preadv(fd, [whole], off)
        else:
            for f in [pool.submit(os.preadv, fd, [b], off + i * piece) for i, b in enumerate(bufs)]:
                f.result()
        ts.append(time.perf_counter() - t)
    ts.sort()
    print(piece >> 10, 'KiB pieces: median %.2f ms, p10 %.2f ms -> %.2f GB/s' % (ts[15] * 1e3, ts[3] * 1e3,
                                                                             4.194 / ts[15] / 1e3))
