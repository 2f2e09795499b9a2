"""What JAX's runtime writes to stderr in a process of several (`specjax.distributed.initialize`), passed through as
it is but for one case: when the runtime's coordination service is lost (process 0, which holds it, died) or
reports a fatal error, JAX aborts the process with a log record, a stack trace and the coordination client's warnings
before it; this says that in one line instead, in the form of `distributed`'s other stops. The process still ends
as JAX ends it (SIGABRT). Where `distributed` stops the process first, with its own line (written here), the client's
warnings held back are dropped likewise.

    python -I specjax/runtime_log.py PROCESS_ID NUM_PROCESSES  < the process's stderr

It runs as a child process (so it outlives the abort), reading the process's file descriptor 2, with the Python
standard library only. The coordination client's warnings are held back until the next other line or for HOLD_S
seconds: they precede the fatal record, and without one they are passed on.
"""

import os
import re
import select
import signal
import sys

HOLD_S = 5.0
RECORD = re.compile(rb"^[IWEF]\d{4} ")  # a log record's first line; other lines continue the one before
FATAL = re.compile(rb"^F\d{4} .*\] Terminating process because the JAX distributed service detected fatal errors.*?"
                   rb"absl::Status: ([^.\n]*)")
CLIENT = re.compile(rb"^[WE]\d{4} .*(preemption_sync_manager|coordination_service_agent)\.cc:")  # its warnings
STOP = re.compile(rb"^specjax: process \d+ of \d+ stops: ")  # `distributed`'s own line: the process ends with it
CONTINUES = re.compile(rb"^(\s|Additional GRPC error information|:UNKNOWN:)")  # a held record's further lines


def stop_line(me: str, n: str, status: bytes) -> bytes:
    why = status.decode(errors="replace").strip() or "a fatal error"
    who = "another process" if me == "0" else "process 0, which holds it,"
    return (f"specjax: process {me} of {n} stops: the runtime's coordination service reports {why} ({who} killed or "
            "crashed?); its uncommitted work is dropped\n").encode()


def main(me: str, n: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the process's to handle; this goes on to its end
    held: list[bytes] = []  # the coordination client's records, held back
    holding = ended = False  # whether the current record is held; whether the fatal record was seen
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], HOLD_S if held else None)
        if not ready:  # the held records had no fatal record after them
            os.write(1, b"".join(held))
            held, holding = [], False
            continue
        data = os.read(0, 1 << 16)
        if not data:
            break
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in (x + b"\n" for x in lines):
            if ended:
                continue  # the abort's stack trace
            if fatal := FATAL.match(line):
                os.write(1, stop_line(me, n, fatal.group(1)))
                held, ended = [], True
            elif STOP.match(line):  # the process says why it stops: what was held is the same loss
                os.write(1, line)
                held, ended = [], True
            elif RECORD.match(line):
                holding = bool(CLIENT.match(line))
                if holding:
                    held.append(line)
                else:
                    os.write(1, b"".join(held) + line)
                    held = []
            elif holding and CONTINUES.match(line):
                held.append(line)
            else:  # a line of the process's own (Python's): after what was held
                os.write(1, b"".join(held) + line)
                held, holding = [], False
    if not ended:
        os.write(1, b"".join(held) + pending)


if __name__ == "__main__":
    main(*sys.argv[1:3])
