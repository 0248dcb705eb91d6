"""Which benchmark loops copy: the copies of the message that XLA puts into
the body of the compiled `lax.fori_loop` of each operation (worker.py's loop
bodies), for mpijax and, if installed, mpi4jax: HLO `copy` instructions in
the while loop's body (and the computations it calls).
    mpirun -n 2 python benchmarks/loop_copies.py [NBYTES]"""

import re
import sys

import jax
import jax.numpy as jnp
from worker import OPS, WORLD, loops, mpi_bodies, shape_of


def computations(text):
    """HLO module text -> {computation name: its lines}."""
    found, name = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            name = head.group(1)
            found[name] = []
        elif name:
            found[name].append(line)
    return found


def body(text):
    """The lines of every while loop's body, and of what it calls, transitively."""
    comps = computations(text)
    todo = [m for lines in comps.values() for line in lines for m in re.findall(r"body=%?([\w.\-]+)", line)]
    seen, lines = set(), []
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        lines += comps[name]
        for line in comps[name]:
            todo += re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)", line)
    return lines


def copies(text):
    """The copies of a float32 array in the compiled while loops' bodies."""
    return [line.strip() for line in body(text) if re.search(r"= f32\[[0-9,]+\]\{[0-9,]*\} copy\(", line)]


def main():
    nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    libraries = {}
    for name in ("mpijax", "mpi4jax"):
        try:
            libraries[name] = __import__(name)
        except ImportError:
            print(f"{name}: not installed")
    print(f"jax {jax.__version__}; float32 messages of {nbytes} bytes; copies of the message in the compiled loop")
    for name, lib in libraries.items():
        bodies = mpi_bodies(lib, WORLD.Dup())
        for op in OPS:
            with_op, _ = loops(bodies[op], lambda f: f)
            x = jnp.ones(shape_of(op, nbytes), jnp.float32)
            found = copies(with_op.lower(x, 10).compile().as_text())
            if WORLD.Get_rank() == 0:
                print(f"{name:8s} {op:10s} {len(found)} in the loop body" + "".join(f"\n    {c[:110]}" for c in found))


if __name__ == "__main__":
    main()
