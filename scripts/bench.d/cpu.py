#!/usr/bin/env python3
"""CPU time of every process of a measurement, for scripts/bench.

  cpu.py run OUT_JSON -- CMD [ARGS...]
      runs CMD (the load generator: wrk, pgbench, redis-benchmark) with this
      process's stdin, stdout and stderr, exits with its status, and writes
      to OUT_JSON the CPU seconds each group of processes used while it ran:

        service    the service (the pid in $BENCH_SERVICE_PID, or comm
                   "idempotency-led..."; a copy of the binary under another
                   name is found by its pid)
        reference  the actix-web reference servers (comm "hello", "redis_consume")
        postgres   every postgres process, with the backends that ended
                   during the run (reaped by the postmaster: its cutime)
        redis      redis-server
        load       CMD and everything it waited for (its rusage)
        other      the machine's busy time not in a group above: kernel
                   threads (ksoftirqd, kworkers), interrupts, other processes

      and the machine's idle time (idle + iowait of /proc/stat), so that a
      run that left the cores idle (bound by latency, not CPU) shows it.

Times come from /proc/<pid>/stat (utime + stime, and cutime + cstime for
postgres) and /proc/stat, in clock ticks (usually 10 ms); over a 10 s run of
two cores that is 0.05 % per tick.
"""
import json
import os
import resource
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")
GROUPS = {
    "postgres": "postgres",
    "redis-server": "redis",
    "hello": "reference",
    "redis_consume": "reference",
}


SERVICE_PID = os.environ.get("BENCH_SERVICE_PID", "")


def group_of(pid, comm):
    if pid == SERVICE_PID or comm.startswith("idempotency-le"):
        return "service"
    return GROUPS.get(comm)


def procs():
    """Seconds of CPU per group, summed over the live processes."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        # comm is in parentheses and may hold spaces: split after the last ')'.
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        g = group_of(pid, comm)
        if g is None:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        # fields[0] is state (field 3); utime, stime, cutime, cstime are fields 14-17.
        utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
        ticks = utime + stime
        if g == "postgres":
            ticks += cutime + cstime
        out[g] = out.get(g, 0) + ticks / TICK
    return out


def machine():
    """(busy, idle) seconds of all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    v = [int(x) for x in parts]
    # user nice system idle iowait irq softirq steal guest guest_nice
    idle = v[3] + v[4]
    busy = sum(v[:8]) - idle
    return busy / TICK, idle / TICK


def run(out_path, cmd):
    p0, (b0, i0), t0 = procs(), machine(), time.monotonic()
    rc = subprocess.call(cmd)
    p1, (b1, i1), t1 = procs(), machine(), time.monotonic()
    load = resource.getrusage(resource.RUSAGE_CHILDREN)
    groups = {g: max(0.0, p1.get(g, 0) - p0.get(g, 0)) for g in set(p0) | set(p1)}
    groups["load"] = load.ru_utime + load.ru_stime
    busy = b1 - b0
    groups["other"] = max(0.0, busy - sum(groups.values()))
    with open(out_path, "w") as f:
        json.dump({"wall_s": round(t1 - t0, 3), "cpus": os.cpu_count(), "busy_s": round(busy, 3),
                   "idle_s": round(i1 - i0, 3), "groups_s": {k: round(v, 3) for k, v in groups.items()}}, f)
    return rc


def main():
    a = sys.argv[1:]
    if len(a) < 4 or a[0] != "run" or a[2] != "--":
        sys.exit(__doc__)
    sys.exit(run(a[1], a[3:]))


if __name__ == "__main__":
    main()
