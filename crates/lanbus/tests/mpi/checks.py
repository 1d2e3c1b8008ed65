"""MPI through the lanbus libfabric provider, from Python (mpi4py): pickled objects (which need
probes), buffers, Bcast, Reduce, Allreduce and Barrier, every result checked. Rank 0 prints
"python checks passed on N ranks". Run with /usr/bin/python3 (Debian's python3-mpi4py)."""

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
failures = 0


def check(cond, what):
    global failures
    if not cond:
        failures += 1
        print(f"rank {rank}: check failed: {what}", flush=True)


# Pickled objects around the ring, small and large (the large one goes by rendezvous).
right, left = (rank + 1) % size, (rank - 1) % size
for n in (3, 50_000):
    obj = {"from": rank, "items": list(range(n)), "text": "lanbus" * (n // 10)}
    req = comm.isend(obj, dest=right, tag=7)
    got = comm.recv(source=left, tag=7)
    req.wait()
    check(got["from"] == left and got["items"] == list(range(n)), f"pickled object of {n} items")

# Any source: rank 0 collects one object from everybody.
if rank == 0:
    seen = set()
    for _ in range(size - 1):
        st = MPI.Status()
        got = comm.recv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st)
        check(got == ("hello", st.Get_source()) and st.Get_tag() == 10 + st.Get_source(), "any source")
        seen.add(st.Get_source())
    check(seen == set(range(1, size)), "every rank once")
else:
    comm.send(("hello", rank), dest=0, tag=10 + rank)
# Rank 0 takes any tag above: nothing else may reach it before it is done.
comm.Barrier()

# Buffers.
for n in (16, 1 << 20):
    out = bytearray((rank * 7 + i) % 251 for i in range(n))
    inp = bytearray(n)
    comm.Sendrecv([out, MPI.BYTE], dest=right, sendtag=3, recvbuf=[inp, MPI.BYTE], source=left, recvtag=3)
    check(inp == bytearray((left * 7 + i) % 251 for i in range(n)), f"buffer of {n} bytes")

# Collectives.
data = comm.bcast({"root": 0, "payload": list(range(1000))} if rank == 0 else None, root=0)
check(data == {"root": 0, "payload": list(range(1000))}, "bcast")
big = bytearray(300_000) if rank != 0 else bytearray(i % 256 for i in range(300_000))
comm.Bcast([big, MPI.BYTE], root=0)
check(big == bytearray(i % 256 for i in range(300_000)), "Bcast of a buffer")
total = comm.reduce(rank + 1, op=MPI.SUM, root=0)
check(rank != 0 or total == size * (size + 1) // 2, "reduce")
check(comm.allreduce(rank, op=MPI.MAX) == size - 1, "allreduce max")
check(comm.allreduce(1, op=MPI.SUM) == size, "allreduce sum")
comm.Barrier()

failures = comm.allreduce(failures, op=MPI.SUM)
if rank == 0:
    print(f"python checks {'passed' if failures == 0 else 'FAILED'} on {size} ranks", flush=True)
raise SystemExit(0 if failures == 0 else 1)
