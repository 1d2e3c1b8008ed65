/*
 * MPI semantics through the lanbus libfabric provider: nonblocking sends and receives with
 * MPI_Waitall, MPI_ANY_SOURCE and MPI_ANY_TAG with their statuses, truncated receives (eager
 * and rendezvous) reported as MPI_ERR_TRUNCATE, synchronous sends, probes and matched probes,
 * and a cancelled receive. Every rank checks what it got; rank 0 prints "checks passed".
 * Run with 2 or more ranks.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, size, failures;

#define CHECK(cond, ...)                                                     \
	do {                                                                 \
		if (!(cond)) {                                               \
			fprintf(stderr, "rank %d: check failed: ", rank);     \
			fprintf(stderr, __VA_ARGS__);                         \
			fprintf(stderr, "\n");                                \
			failures++;                                          \
		}                                                            \
	} while (0)

static unsigned char pattern(int from, int tag, size_t i)
{
	return (unsigned char)(from * 31 + tag * 7 + i * 13);
}

static void fill(unsigned char *b, size_t n, int from, int tag)
{
	for (size_t i = 0; i < n; i++)
		b[i] = pattern(from, tag, i);
}

static int intact(const unsigned char *b, size_t n, int from, int tag)
{
	for (size_t i = 0; i < n; i++)
		if (b[i] != pattern(from, tag, i))
			return 0;
	return 1;
}

/* Every rank sends to every other rank, small and large, all nonblocking, then waits for all. */
static void all_to_all_nonblocking(void)
{
	const size_t sizes[] = {0, 1, 1000, 16384, 16385, 300000, 1 << 20};
	const int nsizes = sizeof(sizes) / sizeof(sizes[0]);
	int n = (size - 1) * nsizes;
	MPI_Request *reqs = calloc(2 * n, sizeof(MPI_Request));
	unsigned char **out = calloc(n, sizeof(void *)), **in = calloc(n, sizeof(void *));
	int k = 0;
	for (int peer = 0; peer < size; peer++) {
		if (peer == rank)
			continue;
		for (int s = 0; s < nsizes; s++, k++) {
			out[k] = malloc(sizes[s] + 1);
			in[k] = malloc(sizes[s] + 1);
			fill(out[k], sizes[s], rank, s);
			MPI_Irecv(in[k], sizes[s], MPI_BYTE, peer, s, MPI_COMM_WORLD, &reqs[2 * k]);
			MPI_Isend(out[k], sizes[s], MPI_BYTE, peer, s, MPI_COMM_WORLD, &reqs[2 * k + 1]);
		}
	}
	MPI_Status *st = calloc(2 * n, sizeof(MPI_Status));
	CHECK(MPI_Waitall(2 * n, reqs, st) == MPI_SUCCESS, "Waitall");
	k = 0;
	for (int peer = 0; peer < size; peer++) {
		if (peer == rank)
			continue;
		for (int s = 0; s < nsizes; s++, k++) {
			int count;
			MPI_Get_count(&st[2 * k], MPI_BYTE, &count);
			CHECK(st[2 * k].MPI_SOURCE == peer && st[2 * k].MPI_TAG == s, "status of %zu bytes", sizes[s]);
			CHECK((size_t)count == sizes[s], "count %d, sent %zu", count, sizes[s]);
			CHECK(intact(in[k], sizes[s], peer, s), "%zu bytes from %d intact", sizes[s], peer);
			free(out[k]);
			free(in[k]);
		}
	}
	free(st), free(reqs), free(out), free(in);
}

/* Rank 0 takes one message from every other rank with MPI_ANY_SOURCE and MPI_ANY_TAG. */
static void wildcards(void)
{
	unsigned char buf[256];
	if (rank == 0) {
		int seen = 0;
		for (int i = 1; i < size; i++) {
			MPI_Status st;
			int count;
			MPI_Recv(buf, sizeof(buf), MPI_BYTE, MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &st);
			MPI_Get_count(&st, MPI_BYTE, &count);
			CHECK(st.MPI_SOURCE > 0 && st.MPI_SOURCE < size, "source %d", st.MPI_SOURCE);
			CHECK(st.MPI_TAG == 100 + st.MPI_SOURCE, "tag %d from %d", st.MPI_TAG, st.MPI_SOURCE);
			CHECK(count == 10 * st.MPI_SOURCE, "count %d from %d", count, st.MPI_SOURCE);
			CHECK(intact(buf, count, st.MPI_SOURCE, st.MPI_TAG), "bytes from %d", st.MPI_SOURCE);
			seen |= 1 << st.MPI_SOURCE;
		}
		CHECK(seen == ((1 << size) - 2), "every rank seen once (%x)", seen);
	} else {
		fill(buf, 10 * rank, rank, 100 + rank);
		MPI_Send(buf, 10 * rank, MPI_BYTE, 0, 100 + rank, MPI_COMM_WORLD);
	}
}

/* Receives shorter than their messages: MPI_ERR_TRUNCATE, for an eager and a rendezvous one. */
static void truncation(void)
{
	const size_t lens[] = {100, 200000};
	MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
	for (int i = 0; i < 2; i++) {
		unsigned char *b = malloc(lens[i]);
		if (rank == 1) {
			fill(b, lens[i], 1, 200 + i);
			MPI_Send(b, lens[i], MPI_BYTE, 0, 200 + i, MPI_COMM_WORLD);
		} else if (rank == 0) {
			MPI_Status st;
			int cls, rc = MPI_Recv(b, 10, MPI_BYTE, 1, 200 + i, MPI_COMM_WORLD, &st);
			MPI_Error_class(rc, &cls);
			CHECK(cls == MPI_ERR_TRUNCATE, "receiving %zu bytes into 10: error class %d", lens[i], cls);
			CHECK(intact(b, 10, 1, 200 + i), "the 10 bytes that fit arrived");
		}
		free(b);
	}
	MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_ARE_FATAL);
}

/* Ssend, Probe, Iprobe, Mprobe/Mrecv and a cancelled receive. */
static void probes_and_cancel(void)
{
	unsigned char b[64];
	if (rank == 1) {
		fill(b, 40, 1, 300);
		MPI_Ssend(b, 40, MPI_BYTE, 0, 300, MPI_COMM_WORLD);
		fill(b, 50, 1, 301);
		MPI_Send(b, 50, MPI_BYTE, 0, 301, MPI_COMM_WORLD);
	} else if (rank == 0) {
		MPI_Status st;
		int count, flag = 0;
		MPI_Probe(1, 300, MPI_COMM_WORLD, &st);
		MPI_Get_count(&st, MPI_BYTE, &count);
		CHECK(count == 40 && st.MPI_TAG == 300, "probe: %d bytes, tag %d", count, st.MPI_TAG);
		MPI_Recv(b, sizeof(b), MPI_BYTE, 1, 300, MPI_COMM_WORLD, &st);
		CHECK(intact(b, 40, 1, 300), "Ssend's bytes");
		while (!flag)
			MPI_Iprobe(MPI_ANY_SOURCE, 301, MPI_COMM_WORLD, &flag, &st);
		MPI_Message msg;
		MPI_Mprobe(1, MPI_ANY_TAG, MPI_COMM_WORLD, &msg, &st);
		MPI_Get_count(&st, MPI_BYTE, &count);
		CHECK(count == 50 && st.MPI_TAG == 301, "mprobe: %d bytes, tag %d", count, st.MPI_TAG);
		MPI_Mrecv(b, sizeof(b), MPI_BYTE, &msg, &st);
		CHECK(intact(b, 50, 1, 301), "Mrecv's bytes");

		MPI_Request r;
		int cancelled = 0;
		MPI_Irecv(b, sizeof(b), MPI_BYTE, 1, 999, MPI_COMM_WORLD, &r);
		MPI_Cancel(&r);
		MPI_Wait(&r, &st);
		MPI_Test_cancelled(&st, &cancelled);
		CHECK(cancelled, "a receive nothing matched is cancelled");
	}
}

int main(int argc, char **argv)
{
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	if (size < 2) {
		fprintf(stderr, "run with 2 or more ranks\n");
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	all_to_all_nonblocking();
	MPI_Barrier(MPI_COMM_WORLD);
	wildcards();
	MPI_Barrier(MPI_COMM_WORLD);
	truncation();
	MPI_Barrier(MPI_COMM_WORLD);
	probes_and_cancel();
	int total = 0;
	MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
	if (rank == 0)
		printf(total == 0 ? "checks passed on %d ranks\n" : "checks FAILED on %d ranks\n", size);
	MPI_Finalize();
	return total == 0 ? 0 : 1;
}
