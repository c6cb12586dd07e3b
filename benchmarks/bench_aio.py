"""Swap I/O bandwidth: zero_ext's AsyncIO (io_uring with the tensor registered as a fixed buffer,
as the engine's swap pools are; io_uring without; its pread/pwrite thread pool) against DeepSpeed's
libaio path (its async_io op) and fio (io_uring and libaio engines), in one run, with each tool's
CPU time per GB (on a 2-core machine the swapper's CPU is taken from the optimizer step it overlaps).

Every tool moves the same bytes of the same pre-written file on the same file system: O_DIRECT,
the same block size and queue depth, one submitting thread, page-aligned buffers (DeepSpeed's own
locked tensors for DeepSpeed, so it takes its no-bounce path). A write is timed with an fsync of the
file at its end (fio: end_fsync=1). Runs are interleaved tool by tool, in an order that rotates
each round (what runs right after a burst of writes pays for the disk's write-back), and the best of
--repeat is shown beside the ratios of our fixed-buffer path to DeepSpeed (both moving a whole
tensor) and of its fio-style run (one small reused buffer, see Ours) to the better fio engine,
each the median over rounds of the ratio within a round: disks and VMs are noisy, so
compare pairwise within this run. Not a test; takes ~6-10 minutes.

Run, with DeepSpeed in a virtualenv of its own (it needs Debian's libaio-dev to build async_io):

    apt-get install -y fio libaio-dev
    python3 -m venv --system-site-packages /tmp/dsvenv && /tmp/dsvenv/bin/pip install deepspeed ninja
    /tmp/dsvenv/bin/python benchmarks/bench_aio.py            # --dir /work/zx_bench_aio by default

Under an interpreter without DeepSpeed (or without fio on PATH) those columns are left out, and
the report says why. The files are deleted at the end.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from zero_ext.nvme.aio import AsyncIO, SwapFile, aligned_empty  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


def human(n):
    return f"{n // GiB} GiB" if n >= GiB else f"{n // MiB} MiB" if n >= MiB else f"{n >> 10} KiB"


class Ours:
    """registered: the tensor is registered with io_uring (fixed buffers), as the engine's swap
    buffer pools are; registering (pinning) happens once, outside the timed calls.
    fio_style: moves the file through one buffer of depth x block bytes, reused for every op, as fio
    does (all ops queued at once), instead of a tensor of the file's size: on this VM a read into a
    few MiB that stay in the caches ran ~25 % faster than into 1 GiB of memory, so only this column
    compares with fio like for like."""

    def __init__(self, backend, registered=False, fio_style=False):
        self.name = "zero_ext " + backend + (" fixed" if registered else "") + (" fio-style" if fio_style else "")
        self.backend, self.registered, self.fio_style = backend, registered, fio_style
        self.handles, self.buffers, self.files = {}, {}, {}

    def _setup(self, path, size, bs, depth):
        if (bs, depth) not in self.handles:
            self.handles[(bs, depth)] = AsyncIO(block_size=bs, queue_depth=depth, backend=self.backend)
        nbuf = min(size, bs * depth) if self.fio_style else size
        if nbuf not in self.buffers:
            self.buffers[nbuf] = aligned_empty(nbuf).random_(0, 256)
        if path not in self.files:
            self.files[path] = SwapFile(path)
        h, buf = self.handles[(bs, depth)], self.buffers[nbuf]
        if self.registered and h.register_buffers([buf]) is False:
            raise RuntimeError("io_uring refused to register the buffer (see the log)")
        return h, buf, self.files[path]

    def _move(self, kind, path, size, bs, depth):
        aio, buf, f = self._setup(path, size, bs, depth)
        submit = aio.submit_write if kind == "write" else aio.submit_read
        t0, c0 = time.perf_counter(), time.process_time()
        for off in range(0, size, buf.numel()):
            submit(buf[:min(buf.numel(), size - off)], f, off)
        aio.wait()
        if kind == "write":
            os.fsync(f.fd)
        return time.perf_counter() - t0, time.process_time() - c0

    def write(self, path, size, bs, depth):
        return self._move("write", path, size, bs, depth)

    def read(self, path, size, bs, depth):
        return self._move("read", path, size, bs, depth)

    def release(self, size=None):
        for h in self.handles.values():
            if not h.closed:
                h.unregister_buffers(None if size is None else [self.buffers[size]] if size in self.buffers else [])
        if size is None:
            for h in self.handles.values():
                h.close()
            for f in self.files.values():
                f.close()
            self.handles, self.files = {}, {}
        self.buffers.pop(size, None) if size else self.buffers.clear()


class DeepSpeedAio:
    """DeepSpeed's aio_handle (libaio): sync_pwrite / sync_pread of a whole file."""

    name = "DeepSpeed libaio"

    def __init__(self, module):
        self.module = module
        self.handles, self.buffers = {}, {}

    def _setup(self, size, bs, depth):
        key = (bs, depth)
        if key not in self.handles:
            # (block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)
            self.handles[key] = self.module.aio_handle(bs, depth, False, True, 1)
        h = self.handles[key]
        if (key, size) not in self.buffers:  # its own locked tensors: no bounce buffer
            buf = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
            buf.random_(0, 256)
            self.buffers[(key, size)] = buf
        return h, self.buffers[(key, size)]

    def write(self, path, size, bs, depth):
        h, buf = self._setup(size, bs, depth)
        t0, c0 = time.perf_counter(), time.process_time()
        h.sync_pwrite(buf, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        return time.perf_counter() - t0, time.process_time() - c0

    def read(self, path, size, bs, depth):
        h, buf = self._setup(size, bs, depth)
        t0, c0 = time.perf_counter(), time.process_time()
        h.sync_pread(buf, path)
        return time.perf_counter() - t0, time.process_time() - c0

    def release(self, size=None):
        for (key, n), buf in list(self.buffers.items()):
            if size is None or n == size:
                self.handles[key].free_cpu_locked_tensor(buf)
                del self.buffers[(key, n)]
        if size is None:
            self.handles = {}


class Fio:
    def __init__(self, engine):
        self.engine = engine
        self.name = "fio " + engine

    def _run(self, rw, path, size, bs, depth):
        cmd = ["fio", "--name=bench", f"--filename={path}", f"--rw={rw}", f"--bs={bs}",
               f"--iodepth={depth}", "--direct=1", f"--ioengine={self.engine}", f"--size={size}",
               "--numjobs=1", "--output-format=json"]
        if rw == "write":
            cmd.append("--end_fsync=1")
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
        if job["error"]:
            raise RuntimeError(f"fio {self.engine}: error {job['error']}")
        secs = size / job[rw]["bw_bytes"]
        return secs, (job["usr_cpu"] + job["sys_cpu"]) / 100 * job[rw]["runtime"] / 1e3

    def write(self, path, size, bs, depth):
        return self._run("write", path, size, bs, depth)

    def read(self, path, size, bs, depth):
        return self._run("read", path, size, bs, depth)

    def release(self, size=None):
        pass


def load_deepspeed():
    """DeepSpeed's async_io module, or the reason it cannot be had here."""
    try:
        import deepspeed

        if "zeroext" in getattr(deepspeed, "__version__", ""):
            return None, (f"the `deepspeed` under {sys.executable} is zero_ext's compatibility package: run this "
                          "script with the python of a venv where DeepSpeed is installed")
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as exc:  # noqa: BLE001 - any failure means: no DeepSpeed column
        return None, f"deepspeed is not importable under {sys.executable} ({type(exc).__name__}: {exc})"
    try:
        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return None, "DeepSpeed's async_io op is not compatible here (libaio-dev missing?)"
        return builder.load(verbose=False), None
    except Exception as exc:  # noqa: BLE001
        return None, f"DeepSpeed's async_io op failed to build or load: {exc}"


def prepare(path, size):
    """Writes the file once, fully (overwrites are measured, as swap files are rewritten)."""
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    chunk = aligned_empty(min(size, 64 * MiB)).random_(0, 256)
    with AsyncIO(queue_depth=16, backend="threads") as aio, SwapFile(path, create=True) as f:
        for off in range(0, size, chunk.numel()):
            aio.write(chunk[:min(chunk.numel(), size - off)], f, off)
        os.fsync(f.fd)


def measure(tools, path, size, bs, depth, repeat, log):
    """{tool name: ([write GB/s of each round], [read GB/s of each round])}, runs interleaved
    across tools; a failed run counts as nan."""
    rates = {t.name: ([], [], [], []) for t in tools}  # writes, reads, their CPU s per GB
    for rep in range(repeat):
        order = tools[rep % len(tools):] + tools[:rep % len(tools)]  # no tool always goes first
        for k, kind in enumerate(("write", "read")):
            for t in order:
                try:
                    secs, cpu = getattr(t, kind)(path, size, bs, depth)
                    rate, cpu = size / secs / 1e9, cpu / (size / 1e9)
                except Exception as exc:  # noqa: BLE001 - report, keep the other columns
                    log(f"  {t.name} {kind} failed: {exc}")
                    rate = cpu = float("nan")
                rates[t.name][k].append(rate)
                rates[t.name][k + 2].append(cpu)
    return rates


def best(xs):
    xs = [x for x in xs if x == x]
    return max(xs) if xs else float("nan")


def paired(ours, theirs):
    """Median over rounds of our rate over theirs in the same round: the disk's state (write-back,
    the host's other tenants) swings 2x between minutes and disturbs a ratio taken within a round
    far less than it disturbs a best-of figure."""
    rs = [a / b for a, b in zip(ours, theirs) if a == a and b == b and b > 0]
    return f"{statistics.median(rs):.2f}" if rs else "-"


def table(title, rows, tools):
    """rows: [(label, {tool: (writes, reads)})] -> markdown: each tool's best round, and our io_uring
    path's paired ratios (see paired) to DeepSpeed and to the better fio engine of each round."""
    names = [t.name for t in tools]
    ds = "DeepSpeed libaio" if "DeepSpeed libaio" in names else None
    fios = [n for n in names if n.startswith("fio ")]
    head = ["case"] + [f"{n} W / R" for n in names]
    if ds:
        head += ["fixed/DS W", "fixed/DS R"]
    if fios:
        head += ["fio-style/best fio W", "fio-style/best fio R"]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cpu = {}
    for label, rates in rows:
        for n in names:
            for k in (0, 1):
                cpu.setdefault((n, k), []).extend(x for x in rates[n][k + 2] if x == x)
        cells = [label] + [f"{best(rates[n][0]):.2f} / {best(rates[n][1]):.2f}" for n in names]
        ours = rates.get("zero_ext uring fixed")
        like_fio = rates.get("zero_ext uring fixed fio-style")
        if ds:
            cells += [paired(ours[k], rates[ds][k]) for k in (0, 1)] if ours else ["-", "-"]
        if fios:
            top = [[best(col) for col in zip(*(rates[n][k] for n in fios))] for k in (0, 1)]
            cells += [paired(like_fio[k], top[k]) for k in (0, 1)] if like_fio else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "CPU seconds per GB moved (median over the rows' rounds; the submitting process's user + "
              "system time, fio's own figure for fio), write / read: " + ", ".join(
                  f"{n} {statistics.median(cpu[(n, 0)] or [float('nan')]):.3f} / "
                  f"{statistics.median(cpu[(n, 1)] or [float('nan')]):.3f}" for n in names)]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/work/zx_bench_aio", help="a directory on the disk to measure")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one small case, to check the set-up")
    args = ap.parse_args()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    tools = [Ours("uring", registered=True), Ours("uring"), Ours("threads"),
             Ours("uring", registered=True, fio_style=True)]
    notes = []
    ds, why = load_deepspeed()
    if ds is not None:
        tools.append(DeepSpeedAio(ds))
    else:
        notes.append(f"DeepSpeed column left out: {why}")
    if shutil.which("fio"):
        tools += [Fio("io_uring"), Fio("libaio")]
    else:
        notes.append("fio columns left out: fio is not on PATH (apt-get install fio)")
    try:
        AsyncIO(backend="uring").close()
    except OSError as exc:
        tools = [t for t in tools if getattr(t, "backend", None) != "uring"]
        notes.append(f"zero_ext io_uring column left out: {exc}")

    os.makedirs(args.dir, exist_ok=True)
    started = time.time()
    out = [f"aio bandwidth, GB/s (1e9 B/s), best round; ratios: median of the rounds' ratios; files in {args.dir} "
           f"({os.uname().release}); write = write + fsync\n"] + [f"- {n}" for n in notes] + [""]
    try:
        if args.quick:
            path = os.path.join(args.dir, "quick.dat")
            prepare(path, 64 * MiB)
            rows = [("64 MiB, bs 1 MiB, depth 8", measure(tools, path, 64 * MiB, MiB, 8, 1, log))]
            out.append(table("quick check", rows, tools))
        else:
            big = os.path.join(args.dir, "2g.dat")
            prepare(big, 2 * GiB)
            log("2 GiB, 1 MiB blocks, depth 32")
            rows = [("2 GiB, bs 1 MiB, depth 32",
                     measure(tools, big, 2 * GiB, MiB, 32, args.repeat + 2, log))]
            out.append(table("Headline (the reference configuration)", rows, tools))

            mid = os.path.join(args.dir, "1g.dat")
            prepare(mid, GiB)
            rows = []
            for bs in (256 << 10, MiB, 4 * MiB):
                for depth in (8, 32):
                    log(f"1 GiB, bs {human(bs)}, depth {depth}")
                    rows.append((f"1 GiB, bs {human(bs)}, depth {depth}",
                                 measure(tools, mid, GiB, bs, depth, max(2, args.repeat - 1), log)))
            out.append(table("Block size x queue depth (1 GiB tensor)", rows, tools))

            rows = []
            for size in (64 * MiB, 256 * MiB):
                path = os.path.join(args.dir, f"{size >> 20}m.dat")
                prepare(path, size)
                log(f"{human(size)}, bs 1 MiB, depth 32")
                rows.append((f"{human(size)}, bs 1 MiB, depth 32",
                             measure(tools, path, size, MiB, 32, args.repeat, log)))
                for t in tools:
                    t.release(size)
            rows.append(("1 GiB, bs 1 MiB, depth 32", measure(tools, mid, GiB, MiB, 32, args.repeat, log)))
            out.append(table("Tensor size (bs 1 MiB, depth 32)", rows, tools))
    finally:
        for t in tools:
            t.release()
        shutil.rmtree(args.dir, ignore_errors=True)
    out.append(f"({time.time() - started:.0f} s)")
    print("\n".join(out))


if __name__ == "__main__":
    main()
