#!/usr/bin/env python3
"""CPU time of every process of a measurement, for scripts/bench.

  cpu.py run OUT_JSON [--window SECONDS] -- CMD [ARGS...]
      runs CMD (the load generator: wrk, pgbench, redis-benchmark) with this
      process's stdin, stdout and stderr, exits with its status, and writes
      to OUT_JSON the CPU seconds each group of processes used:

        service    the service (the pid in $BENCH_SERVICE_PID, or comm
                   "idempotency-led..."; a copy of the binary under another
                   name is found by its pid)
        reference  the actix-web reference servers (comm "hello", "redis_consume")
        peer       the peer server of the key scenarios (the pid in
                   $BENCH_PEER_PID, set only for the peer's runs; the
                   service, idle meanwhile, then counts as `other`)
        postgres   every postgres process, with the backends that ended
                   (reaped by the postmaster: its cutime)
        redis      redis-server
        load       wrk, pgbench, redis-benchmark
        other      the machine's busy time not in a group above: kernel
                   threads (ksoftirqd, kworkers), interrupts, other processes

      and the machine's idle time (idle + iowait of /proc/stat), so that a
      run that left the cores idle (bound by latency, not CPU) shows it, and
      the time the hypervisor gave the cores to someone else (steal), which
      is no group's and not in the machine's busy time.
      What `other` holds is named: the processes outside every group that
      used the most CPU in the window, with the children they reaped (by
      name, up to five; a child reaped in the window counts whole).

      Every process is read every 0.25 s while CMD runs. The measured window
      ends at the last reading in which the load generator was alive; with --window it starts
      SECONDS before that (wrk measures its last -d seconds: the seconds
      before, in which its threads load their token files, are left out),
      else at the start. OUT_JSON holds the window's length and the group
      totals over it.

Times come from /proc/<pid>/stat (utime + stime, and cutime + cstime for
postgres) and /proc/stat, in clock ticks (usually 10 ms).
"""
import json
import os
import subprocess
import sys
import threading
import time

TICK = os.sysconf("SC_CLK_TCK")
EVERY = 0.25
GROUPS = {
    "postgres": "postgres",
    "redis-server": "redis",
    "hello": "reference",
    "redis_consume": "reference",
    "wrk": "load",
    "pgbench": "load",
    "redis-benchmark": "load",
}
SERVICE_PID = os.environ.get("BENCH_SERVICE_PID", "")
PEER_PID = os.environ.get("BENCH_PEER_PID", "")


def group_of(pid, comm):
    if PEER_PID:
        return "peer" if pid == PEER_PID else GROUPS.get(comm)
    if pid == SERVICE_PID or comm.startswith("idempotency-le"):
        return "service"
    return GROUPS.get(comm)


def reading():
    """(monotonic time, seconds of CPU per group, machine busy s, machine idle s,
    {pid: (name, s)} of the processes outside every group, machine steal s)."""
    groups = {}
    outside = {}
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
        fields = raw[raw.rindex(")") + 2:].split()
        # fields[0] is state (field 3); utime, stime, cutime, cstime are fields 14-17.
        utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
        ticks = utime + stime
        if g is None:
            # With the children it reaped: a process that runs short ones.
            outside[pid] = (comm, (ticks + cutime + cstime) / TICK)
            continue
        if g == "postgres":
            ticks += cutime + cstime
        groups[g] = groups.get(g, 0) + ticks / TICK
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal guest guest_nice
    idle = v[3] + v[4]
    steal = v[7]
    busy = sum(v[:7]) - idle
    return time.monotonic(), groups, busy / TICK, idle / TICK, outside, steal / TICK


def run(out_path, window, cmd):
    readings = [reading()]
    child = subprocess.Popen(cmd)
    stop = threading.Event()

    def sample():
        while not stop.wait(EVERY):
            if child.poll() is not None:
                return
            readings.append(reading())

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    rc = child.wait()
    stop.set()
    t.join()
    # The last reading with the load generator alive (it may exit a moment
    # before the `timeout` around it, and its CPU would then be lost).
    alive = [r for r in readings[1:] if "load" in r[1]]
    end = alive[-1] if alive else readings[-1]
    start = readings[0]
    if window:
        for r in readings:
            if r[0] >= end[0] - window:
                start = r
                break
    span = end[0] - start[0]
    groups = {g: max(0.0, end[1].get(g, 0) - start[1].get(g, 0)) for g in set(start[1]) | set(end[1])}
    busy = end[2] - start[2]
    groups["other"] = max(0.0, busy - sum(groups.values()))
    # The processes outside every group alive at both ends, by name.
    by_name = {}
    for pid, (comm, secs) in end[4].items():
        if pid in start[4] and start[4][pid][0] == comm:
            by_name[comm] = by_name.get(comm, 0.0) + secs - start[4][pid][1]
    top = sorted(((n, round(t, 3)) for n, t in by_name.items() if t > 0), key=lambda x: -x[1])[:5]
    with open(out_path, "w") as f:
        json.dump({"span_s": round(span, 3), "window_s": window, "cpus": os.cpu_count(),
                   "busy_s": round(busy, 3), "idle_s": round(end[3] - start[3], 3),
                   "groups_s": {k: round(v, 3) for k, v in groups.items()},
                   "steal_s": round(end[5] - start[5], 3), "other_top_s": top}, f)
    return rc


def main():
    a = sys.argv[1:]
    if len(a) < 4 or a[0] != "run":
        sys.exit(__doc__)
    out, rest = a[1], a[2:]
    window = None
    if rest[0] == "--window":
        window = float(rest[1])
        rest = rest[2:]
    if not rest or rest[0] != "--" or len(rest) < 2:
        sys.exit(__doc__)
    sys.exit(run(out, window, rest[1:]))


if __name__ == "__main__":
    main()
