"""The Markdown report and plots of a benchmark run (see run.py)."""

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from run import MARKS, OPS, WHAT, human  # noqa: E402

RAW = "raw MPI (C++)"
MPIJAX = "mpijax"
CHECK = "mpijax, check mode"  # its own section, not a peer


def _by_impl(results):
    table = {}
    for r in results:
        if "op" in r:
            table.setdefault(r["impl"], {})[(r["op"], r["bytes"])] = r
    return table


def _order(table):
    first = [RAW, MPIJAX]
    return first + sorted(name for name in table if name not in (*first, CHECK))


def _cell(record):
    return f"{record['median']:.2f}" if record else "—"


def _ratio(a, b):
    return f"{a['median'] / b['median']:.2f}" if a and b and b["median"] > 0 else "—"


def _rounds(setup):
    rounds = setup.get("rounds", 1)
    if rounds == 1:
        return "a full run has every case come round several times (this one, once)."
    return (f"every case comes round {rounds} times, minutes apart, with {setup['reps'] // rounds} "
            "repetitions each, and the medians are over all of them.")  # fmt: skip


def _spread(table, setup):
    """How far a case's repetitions of one round, taken back to back, differ from 1 MiB up."""
    per_round = setup["reps"] // setup.get("rounds", 1)
    ratios = sorted(
        max(group) / min(group)
        for cases in table.values()
        for (_, nbytes), record in cases.items()
        if nbytes >= 2**20
        for group in (record["times"][i : i + per_round] for i in range(0, len(record["times"]), per_round))
        if min(group) > 0
    )
    if not ratios:
        return "repetitions of a case seconds apart may differ"
    return (f"the slowest of a case's back-to-back repetitions took {ratios[len(ratios) // 2]:.2f} times the\n"
            f"  fastest's at the median from 1 MiB up, and up to {ratios[-1]:.1f} times")  # fmt: skip


def _order_of_runs(setup, table):
    """How the implementations' timings of a case were taken, from the run's setup."""
    if "interleaved" not in setup:  # runs before every implementation joined the rotation
        return f"""So the C++ reference, mpijax and mpi4jax run interleaved: each is a
  server under its own `mpirun`, asked for one case at a time in an order that rotates from case
  to case (the idle ones sleep), so the timings of a case are taken within seconds of each
  other; so is mpijax in check mode, at the summary's sizes. Even so, {_spread(table, setup)}, so
  {_rounds(setup)}
  In this run mpi4py and JAX's collectives ran one after the other, after the rotation, with
  all their repetitions in one go; and mpi4py's allgather handed its input on to the next call
  without converting its result to a JAX array, so its allgather times leave out the copy that
  its other operations include."""
    return f"""So every implementation runs interleaved: each is a server under its
  own `mpirun`, asked for one case at a time in an order that rotates from case to case (the idle
  ones sleep), so the timings of a case are taken within seconds of each other; mpijax in check
  mode joins the rotation at the summary's sizes. Even so, {_spread(table, setup)}, so
  {_rounds(setup)}"""


def _pages(setup):
    if setup.get("hugepages"):
        return """Every implementation ran under
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (`--hugepages`), so that glibc's malloc asks for
transparent huge pages for XLA's buffers and the C++ reference's `std::vector`, as NumPy does
for its arrays of 4 MiB and more ([performance.md](../performance.md))."""
    return """Every implementation ran as it comes: XLA's buffers and the C++
reference's `std::vector` on 4 KiB pages, NumPy's arrays of 4 MiB and more on transparent huge
pages; `--hugepages` gives all of them huge pages ([performance.md](../performance.md))."""


def _swing(table):
    """How far the repetitions of one case spread in this run."""
    record = table.get(RAW, {}).get(("pingpong", 65536))
    if not record:
        return ""
    return (f"the same C++ 64 KiB ping-pong took from {record['min']:.1f} µs to {record['max']:.1f} µs one\n"
            "  way, from one repetition to another, in this run. ")  # fmt: skip


def _method(setup, table):
    reruns = "".join(f"; rerun {r}" for r in setup.get("reruns", []))
    return f"""## Method

OSU micro-benchmark style, on {setup["machine"]}, {setup["mpi"]}, Python {setup["python"]},
{setup["date"]}{" (quick run)" if setup["quick"] else ""}{reruns}. Two ranks under `mpirun -n 2`,
each bound to a core, with one XLA thread per rank
(`XLA_FLAGS=--xla_cpu_multi_thread_eigen=false`). {_pages(setup)}

- Messages of float32, from 8 B to 64 MiB. For each operation and size: {setup["reps"]} repetitions
  of `clip(256 MiB / size, 40, 10000)` calls between barriers (one call of the C++ sendrecv or
  ping-pong, or of mpi4py's ping-pong, is two operations; the JAX loops count operations), each
  round of them after one warm-up repetition. A repetition's time is the slowest rank's; the
  tables give the median over repetitions (min, max and every repetition are in results.json).
  Times are microseconds per operation. For the ping-pong, that is one way (half a round trip).
- **raw MPI (C++)**: `benchmarks/raw_mpi.cc`, the same MPI calls from C++, built by CMake: the
  C++ reference that the bindings are compared with. It is not a lower bound: the same MPI calls
  on NumPy arrays, which NumPy puts on transparent huge pages, beat it at some sizes from 1 MiB
  up (`huge_pages.log`; see "How to read the misses"). Its data flows as
  in the JAX loops below (reductions in place, the ping-pong echoes what it received, sendrecv
  alternates two buffers, sendrecv_inplace is `MPI_Sendrecv_replace`), at `MPI_THREAD_MULTIPLE`
  like every Python binding: a buffer one rank has just written costs the other rank more to
  read than one it only reads, and a reference that skipped that would flatter the C++ side.
- This machine is a virtual machine with 2 cores, and it has slow phases that last minutes:
  {_swing(table)}{_order_of_runs(setup, table)}
- **mpijax**, **mpi4jax** and **JAX shard_map**: the operations run inside one jitted
  `lax.fori_loop`, and the time of the same loop without the operation is subtracted, so Python
  and JAX dispatch are not counted. Same-shape results feed the next iteration (in place where
  the binding can); for allgather and alltoall, one element of the result, at an index XLA cannot
  know in advance, is written back into the input, so that no collective can be hoisted out of
  the loop.
- **mpi4py + NumPy**: a Python loop that hands NumPy views of JAX arrays to mpi4py (writable copies
  for bcast and `Sendrecv_replace`) and copies the results back into JAX arrays (`jnp.asarray`),
  which is what a JAX user does without a binding. Its times include that overhead.
- **JAX shard_map**: `jax.distributed` with the gloo CPU collectives (TCP, bound to 127.0.0.1);
  `psum`, `all_gather`, `all_to_all`, `ppermute`, and for bcast a `psum` of the root's value
  (`lax.pbroadcast` has no CPU lowering in JAX 0.10.2: `pbroadcast_probe.log`). gloo takes about a millisecond per
  operation, so this one runs a fiftieth of the iterations (at least 10).
- **Not compared: JAX's MPI collectives** (`jax_cpu_collectives_implementation="mpi"`). JAX
  reaches MPI through MPItrampoline, which needs `MPITRAMPOLINE_LIB` to name an MPIwrapper
  library built for the MPI in use; neither Debian 12 nor PyPI has MPIwrapper. Without it, or
  with Open MPI's `libmpi.so` in its place, the job ends at start-up
  (`jax_mpi_collectives.log`, from `benchmarks/jax_mpi_collectives.py`).

Operations: {"; ".join(f"{op}: {WHAT[op]}" for op in OPS)}.
"""


def _summary(table, impls):
    peers = [name for name in impls if name not in (RAW, MPIJAX)]
    head = ["op", "size", *impls, "mpijax / raw", *[f"mpijax / {p}" for p in peers]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for op in OPS:
        for nbytes, label in MARKS.items():
            cells = [table[name].get((op, nbytes)) for name in impls]
            mine, raw = table[MPIJAX].get((op, nbytes)), table[RAW].get((op, nbytes))
            if mine is None:
                continue
            ratios = [_ratio(mine, raw)] + [_ratio(mine, table[p].get((op, nbytes))) for p in peers]
            lines.append("| " + " | ".join([op, label, *map(_cell, cells), *ratios]) + " |")
    return "\n".join(lines)


READING = """How to read the misses. The targets are the issue's: at 8 B, mpijax within 1 µs of the C++
reference; from 1 MiB up, at least 95 % of its bandwidth at every size. At 8 B, mpijax's gap to
the C++ reference is the cost of one XLA custom call around the same MPI call, which mpi4jax
pays too (the 8 B rows). From 1 MiB up, repetitions of one case fall into groups, one per
round, that can differ several-fold (every repetition is in results.json), and how the buffer's
memory is mapped matters: `benchmarks/buffer_memory.py` times the same 16 MiB `MPI_Bcast` from
a NumPy array, which NumPy puts mostly on transparent huge pages, and from plain 4 KiB pages,
which is where XLA's buffers are (`buffer_memory.log`: the NumPy array was faster in each of its
three runs, by 1.15 to 1.98 times, on a loaded machine). The C++ reference is therefore no lower
bound: its `std::vector`, like the plain pages there, gets no huge pages (they are
`madvise`-only on this machine), and MPI calls on NumPy arrays beat it at some sizes
(`huge_pages.log`'s numpy rows). Started with
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, mpijax and the C++ reference get huge pages too, and
then match or beat mpi4py on NumPy arrays at most sizes (`huge_pages.log`, from
`benchmarks/huge_pages.py`; what to do is in [docs/performance.md](../performance.md)). There,
over 9 rounds, mpijax took 0.48 to 1.28 times the C++ reference's time on the same pages (both
plain, or both huge), while the reference's own time for one case changed up to 3.2 times from
one start of its processes to the next: this machine cannot resolve the 95 % target from 1 MiB
up.
mpijax's compiled loops have no copy of the message except sendrecv_inplace's, whose result
cannot be written over the array it sends and is copied back into the loop's carry (for
mpi4jax too); mpi4jax's allreduce loop copies the message every iteration (`loop_copies.log`,
from `benchmarks/loop_copies.py`). Such a loop sends memory written since its last call, which
on this machine cost 1.6 to 7.3 times as much as resending an unchanged buffer at 1 MiB
([performance.md](../performance.md#memory-written-just-before-it-is-sent))."""


def _targets(table):
    """The issue's targets, checked on the medians (not asserted anywhere)."""
    mine, raw = table[MPIJAX], table[RAW]
    mpi4jax = next((t for name, t in table.items() if name.startswith("mpi4jax")), {})
    lines = ["| op | 8 B: mpijax − raw (target ≤ 1 µs) | ≥ 1 MiB: worst raw / mpijax bandwidth (target ≥ 95 %) "
             "| sizes where mpijax is slower than mpi4jax by > 5 % |", "| --- | --- | --- | --- |"]  # fmt: skip
    for op in OPS:
        if (op, 8) not in mine:
            continue
        gap = mine[(op, 8)]["median"] - raw[(op, 8)]["median"]
        big = [b for (o, b) in mine if o == op and b >= 2**20 and (o, b) in raw]
        worst = min((raw[(op, b)]["median"] / mine[(op, b)]["median"] for b in big), default=math.nan)
        slower = [
            human(b)
            for (o, b), rec in sorted(mine.items())
            if o == op and (o, b) in mpi4jax and rec["median"] > 1.05 * mpi4jax[(o, b)]["median"]
        ]
        lines.append(
            f"| {op} | {gap:+.2f} µs {'met' if gap <= 1 else 'missed'} "
            f"| {100 * worst:.0f} % {'met' if worst >= 0.95 else 'missed'} "
            f"| {', '.join(slower) if slower else 'none'} |"
        )
    return "\n".join(lines)


def _check_mode(table):
    if CHECK not in table:
        return ""
    lines = ["| op | size | mpijax | mpijax, check mode | extra µs per call |", "| --- | --- | --- | --- | --- |"]
    for op in OPS:
        for nbytes, label in MARKS.items():
            plain, checked = table[MPIJAX].get((op, nbytes)), table[CHECK].get((op, nbytes))
            if plain and checked:
                extra = checked["median"] - plain["median"]
                cost = f"{extra:+.2f}" if extra >= 0 else f"noise ({extra:+.2f})"
                lines.append(f"| {op} | {label} | {_cell(plain)} | {_cell(checked)} | {cost} |")
    return (
        "## Check mode\n\nThe cost of `MPIJAX_CHECK=1`, measured the same way: before each collective an "
        "allgather of a\n120-byte signature, before each message a handshake with the peer (one more round "
        "trip). Check mode\nonly adds work, so a negative difference is the machine's noise, not a saving: "
        "it is shown as\nnoise, and at those sizes the table cannot tell the check's cost from the noise."
        "\n\n" + "\n".join(lines) + "\n\n"
    )


def _extras(results):
    dispatch = next((r["dispatch_us"] for r in results if "dispatch_us" in r), None)
    memory = next((r["memory"] for r in results if "memory" in r), None)
    text = "## Dispatch cost and memory\n\n"
    if dispatch:
        base_eager, base_jit = dispatch["without MPI (x * 1.0)"]

        def cell(us, base):
            return "—" if us is None else f"{us:.1f} ({us / base:.2f}×)"

        rows = "\n".join(
            f"| {name} | {cell(eager, base_eager)} | {cell(jitted, base_jit)} |"
            for name, (eager, jitted) in dispatch.items()
        )
        text += f"""Wall time of one call, over 5,000 calls in a row (best of three; fewer, half a second's worth
but at least 20, where a call takes longer than 100 µs), at one rank, so that no waiting on
another rank is counted: the call alone (eager), and a jitted function that makes the call and
multiplies by 1.0; in brackets, the ratio to the same without MPI. An ordered JAX
effect takes a function off JAX's C++ fast dispatch path (JAX's own ordered `io_callback`
shows what that costs); mpijax seals its effect into each program at the top level, so its
programs keep the fast path (docs/design.md, section 3). mpi4jax and `io_callback` are timed
before mpijax is imported, since mpijax changes how JAX passes the runtime token of every
ordered effect. mpi4py is the MPI call from Python on NumPy arrays, with no JAX. Inside a
jitted loop the per-operation cost is the one in the tables above.

| 8-byte allreduce | eager µs per call | jitted µs per call |
| --- | --- | --- |
{rows}

"""
    if memory:
        text += f"""Memory (resident set, the larger of two ranks'): {memory["rss_before_mib"]:.1f} MiB after warm-up,
{memory["rss_after_mib"]:.1f} MiB after {memory["calls"]:,} more jitted calls that each make an allreduce
(growth {memory["rss_after_mib"] - memory["rss_before_mib"]:+.1f} MiB); peak {memory["peak_rss_mib"]:.1f} MiB per rank.
"""
    return text


def _full_tables(table, impls):
    out = []
    for op in OPS:
        sizes = sorted(b for (o, b) in table[MPIJAX] if o == op)
        out.append(f"### {op}\n\n![{op}]({op}.png)\n")
        head = ["size", *impls, "mpijax / raw"]
        out += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for b in sizes:
            cells = [_cell(table[name].get((op, b))) for name in impls]
            ratio = _ratio(table[MPIJAX][(op, b)], table[RAW].get((op, b)))
            out.append(f"| {human(b)} | " + " | ".join(cells) + f" | {ratio} |")
        out.append("")
    return "\n".join(out)


def _plot(table, impls, output):
    for op in OPS:
        fig, (latency, bandwidth) = plt.subplots(1, 2, figsize=(11, 4))
        for name in impls:
            points = sorted((b, r["median"]) for (o, b), r in table[name].items() if o == op)
            if not points:
                continue
            sizes = [b for b, _ in points]
            latency.plot(sizes, [t for _, t in points], marker="o", markersize=3, label=name)
            bandwidth.plot(sizes, [b / t / 1e3 for b, t in points], marker="o", markersize=3, label=name)
        latency.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="µs per operation")
        bandwidth.set(xscale="log", xlabel="message size (bytes)", ylabel="GB/s (size / time)")
        latency.set_title(f"{op}: latency")
        bandwidth.set_title(f"{op}: bandwidth")
        for ax in (latency, bandwidth):
            ax.grid(True, which="both", alpha=0.3)
        bandwidth.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(output / f"{op}.png", dpi=110)
        plt.close(fig)


def write_report(results, setup, output):
    table = _by_impl(results)
    impls = _order(table)
    _plot(table, impls, output)
    flags = "".join(f" --{flag}" for flag in ("quick", "hugepages") if setup.get(flag))
    text = f"""# Benchmarks

Generated by `python benchmarks/run.py{flags}` in {setup["minutes"]} min.
Re-run it to reproduce; `results.json` has every number.

{_method(setup, table)}
## Summary (median µs per operation; ratios below 1 mean mpijax is faster)

{_summary(table, impls)}

## Targets

{_targets(table)}

{READING}

{_extras(results)}
{_check_mode(table)}## All sizes

{_full_tables(table, impls)}"""
    (output / "README.md").write_text(text)


def write_gpu_report(results, setup, output):
    """The GPU run: staged mpijax and mpi4jax (and CUDA-aware, where they
    ran so) against the copy bound."""
    table = _by_impl(results)
    bound = table.pop("device-host-device copy (C++)", {})
    peers = sorted(name for name in table if name != MPIJAX)
    head = ["op", "size", "copy bound", MPIJAX, *peers, "mpijax / bound", *[f"mpijax / {p}" for p in peers]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for op in OPS:
        for nbytes in sorted(b for (o, b) in table.get(MPIJAX, {}) if o == op):
            mine, copy = table[MPIJAX][(op, nbytes)], bound.get(("copy", nbytes))
            others = [table[p].get((op, nbytes)) for p in peers]
            ratios = [_ratio(mine, copy)] + [_ratio(mine, other) for other in others]
            cells = [op, human(nbytes), _cell(copy), _cell(mine), *map(_cell, others), *ratios]
            lines.append("| " + " | ".join(cells) + " |")
    sharing = "through an MPS daemon" if setup.get("mps") else "taking turns on it (no MPS daemon)"
    gpu = setup.get("gpu_name", "a GPU")
    failed = ", ".join(setup.get("failed", []))
    if failed:
        failed = f"""

These stages ended with an error (the run's log says which): {failed}. The table has the cases
they finished before it, and a dash for the rest."""
    text = f"""# GPU benchmarks

Generated by `python benchmarks/run.py --gpu` in {setup["minutes"]} min on {gpu}, {setup["machine"]},
{setup["mpi"]}, {setup["date"]}. `results.json` has every number.

Two ranks share the GPU, {sharing}. The operations run as in the CPU benchmarks
(docs/benchmarks/README.md): inside one jitted `lax.fori_loop` on arrays on the GPU (with a tenth of
the iterations), the empty loop's time subtracted, the median of {setup["reps"]} repetitions of the
slowest rank. mpijax runs in its default, staged mode (device data through reused pinned host
buffers), and so does mpi4jax; where the MPI library says it can move device memory, both run
again handing it device pointers (the columns marked CUDA-aware). The bound is
`benchmarks/copy_bound.cc`, one device-to-host and one host-to-device copy of the message on one
stream, with the wait in between that a staged call makes before MPI reads: what staging costs at
least, MPI not counted. Times are microseconds per operation.{failed}

{chr(10).join(lines)}

{_extras(results)}"""
    (output / "README.md").write_text(text)
