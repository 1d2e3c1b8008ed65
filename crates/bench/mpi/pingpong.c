/*
 * Ping-pong latency and osu_bw-style streaming bandwidth between ranks 0 and 1, built with mpicc
 * by `lanbus bench msg --mpi` and run under mpirun (the lanbus provider or Open MPI's tcp BTL).
 *
 *   pingpong WINDOW SIZE...
 *
 * For each size rank 0 prints "SIZE LATENCY_US BANDWIDTH_MBPS": the latency is half the mean
 * round trip of the best of three trials (after a warm-up), the bandwidth the best of three
 * trials of WINDOW messages sent back to back and answered by one short message (0 = not
 * measured). Iterations shrink with the size so that a trial moves a few MiB at most.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank;

static int iterations(long size)
{
	long n = (8L << 20) / (size + 1);
	return n < 20 ? 20 : n > 2000 ? 2000 : (int)n;
}

static double round_trips(char *buf, long size, int n)
{
	MPI_Barrier(MPI_COMM_WORLD);
	double start = MPI_Wtime();
	for (int i = 0; i < n; i++) {
		if (rank == 0) {
			MPI_Send(buf, size, MPI_BYTE, 1, 1, MPI_COMM_WORLD);
			MPI_Recv(buf, size, MPI_BYTE, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		} else {
			MPI_Recv(buf, size, MPI_BYTE, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
			MPI_Send(buf, size, MPI_BYTE, 0, 1, MPI_COMM_WORLD);
		}
	}
	return (MPI_Wtime() - start) / n / 2 * 1e6;
}

static double streaming(char *buf, long size, int window, int n)
{
	MPI_Request *r = malloc(window * sizeof(MPI_Request));
	char ack = 0;
	MPI_Barrier(MPI_COMM_WORLD);
	double start = MPI_Wtime();
	for (int i = 0; i < n; i++) {
		for (int w = 0; w < window; w++) {
			if (rank == 0)
				MPI_Isend(buf, size, MPI_BYTE, 1, 2, MPI_COMM_WORLD, &r[w]);
			else
				MPI_Irecv(buf, size, MPI_BYTE, 0, 2, MPI_COMM_WORLD, &r[w]);
		}
		MPI_Waitall(window, r, MPI_STATUSES_IGNORE);
		if (rank == 0)
			MPI_Recv(&ack, 1, MPI_BYTE, 1, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		else
			MPI_Send(&ack, 1, MPI_BYTE, 0, 3, MPI_COMM_WORLD);
	}
	double secs = MPI_Wtime() - start;
	free(r);
	return (double)size * window * n / secs / 1e6;
}

int main(int argc, char **argv)
{
	int size;
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	if (size != 2 || argc < 3) {
		if (rank == 0)
			fprintf(stderr, "usage: mpirun -np 2 pingpong WINDOW SIZE...\n");
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	/* Rank 0 speaks first, so one side opens each connection: Open MPI's tcp BTL can wedge
	 * when both ranks connect to each other at the same moment (as a first barrier does). */
	char hello = 0;
	if (rank == 0) {
		MPI_Send(&hello, 1, MPI_BYTE, 1, 4, MPI_COMM_WORLD);
		MPI_Recv(&hello, 1, MPI_BYTE, 1, 4, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
	} else {
		MPI_Recv(&hello, 1, MPI_BYTE, 0, 4, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		MPI_Send(&hello, 1, MPI_BYTE, 0, 4, MPI_COMM_WORLD);
	}
	int window = atoi(argv[1]);
	for (int a = 2; a < argc; a++) {
		long bytes = atol(argv[a]);
		char *buf = malloc(bytes + 1);
		memset(buf, 0x5a, bytes + 1);
		int n = iterations(bytes);
		round_trips(buf, bytes, n / 10 + 1);
		double lat = 1e30, bw = 0;
		for (int t = 0; t < 3; t++) {
			double us = round_trips(buf, bytes, n);
			lat = us < lat ? us : lat;
		}
		if (window > 0) {
			int w = n / window < 2 ? 2 : n / window;
			streaming(buf, bytes, window, 1);
			for (int t = 0; t < 3; t++) {
				double mbs = streaming(buf, bytes, window, w);
				bw = mbs > bw ? mbs : bw;
			}
		}
		if (rank == 0) {
			printf("%ld %.3f %.1f\n", bytes, lat, bw);
			fflush(stdout);
		}
		free(buf);
	}
	MPI_Finalize();
	return 0;
}
