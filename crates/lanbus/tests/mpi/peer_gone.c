/*
 * A peer killed in the middle of a run, seen through libfabric alone (no MPI launcher, which
 * would abort the job by itself).
 *
 *   peer_gone serve FILE    opens an endpoint, writes its address (hex) to FILE, waits forever
 *   peer_gone client FILE   reads the address, posts a receive from it and a 1 MiB send to it
 *                           (rendezvous: it waits for the peer's receive), prints "posted",
 *                           then reads the CQ until both complete
 *
 * The client exits 0 when both operations complete with FI_EHOSTUNREACH through fi_cq_readerr
 * within 20 s, and prints what it saw; 1 otherwise. The test kills the server after "posted".
 */
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TRY(call)                                                                  \
	do {                                                                       \
		int rc_ = (int)(call);                                             \
		if (rc_ < 0) {                                                     \
			fprintf(stderr, "%s: %s\n", #call, fi_strerror(-rc_));     \
			exit(2);                                                   \
		}                                                                  \
	} while (0)

static struct fid_fabric *fabric;
static struct fid_domain *domain;
static struct fid_ep *ep;
static struct fid_av *av;
static struct fid_cq *cq;

static void open_endpoint(void)
{
	struct fi_info *hints = fi_allocinfo(), *info;
	struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_TAGGED};
	struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
	hints->caps = FI_TAGGED | FI_DIRECTED_RECV;
	hints->ep_attr->type = FI_EP_RDM;
	hints->fabric_attr->prov_name = strdup("lanbus");
	TRY(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &info));
	TRY(fi_fabric(info->fabric_attr, &fabric, NULL));
	TRY(fi_domain(fabric, info, &domain, NULL));
	TRY(fi_endpoint(domain, info, &ep, NULL));
	TRY(fi_cq_open(domain, &cq_attr, &cq, NULL));
	TRY(fi_av_open(domain, &av_attr, &av, NULL));
	TRY(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
	TRY(fi_ep_bind(ep, &av->fid, 0));
	TRY(fi_enable(ep));
	fi_freeinfo(hints);
	fi_freeinfo(info);
}

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	unsigned char name[64];
	size_t len = sizeof(name);
	if (argc != 3 || (strcmp(argv[1], "serve") && strcmp(argv[1], "client"))) {
		fprintf(stderr, "usage: peer_gone serve|client FILE\n");
		return 2;
	}
	open_endpoint();
	if (!strcmp(argv[1], "serve")) {
		char tmp[4096];
		TRY(fi_getname(&ep->fid, name, &len));
		snprintf(tmp, sizeof(tmp), "%s.tmp", argv[2]);
		FILE *f = fopen(tmp, "w");
		for (size_t i = 0; i < len; i++)
			fprintf(f, "%02x", name[i]);
		fclose(f);
		rename(tmp, argv[2]);
		for (;;)
			pause();
	}
	FILE *f = fopen(argv[2], "r");
	if (!f)
		return 2;
	len = 0;
	unsigned int byte;
	while (len < sizeof(name) && fscanf(f, "%2x", &byte) == 1)
		name[len++] = (unsigned char)byte;
	fclose(f);
	fi_addr_t peer;
	if (fi_av_insert(av, name, 1, &peer, 0, NULL) != 1)
		return 2;
	static char in[64], out[1 << 20];
	static struct fi_context recv_ctx, send_ctx;
	TRY(fi_trecv(ep, in, sizeof(in), NULL, peer, 5, 0, &recv_ctx));
	TRY(fi_tsend(ep, out, sizeof(out), NULL, peer, 6, &send_ctx));
	printf("posted\n");
	fflush(stdout);
	int recv_err = 0, send_err = 0;
	double start = now();
	while ((!recv_err || !send_err) && now() - start < 20) {
		struct fi_cq_tagged_entry e;
		ssize_t n = fi_cq_read(cq, &e, 1);
		if (n == -FI_EAVAIL) {
			struct fi_cq_err_entry err = {0};
			TRY(fi_cq_readerr(cq, &err, 0));
			const char *what = err.op_context == &recv_ctx ? "receive" : "send";
			printf("%s failed after %.3f s: %s\n", what, now() - start, fi_strerror(err.err));
			if (err.op_context == &recv_ctx)
				recv_err = err.err;
			else
				send_err = err.err;
		} else if (n > 0) {
			printf("unexpected success of the %s\n", e.op_context == &recv_ctx ? "receive" : "send");
			return 1;
		} else if (n != -FI_EAGAIN) {
			TRY(n);
		}
	}
	fi_close(&ep->fid);
	fi_close(&cq->fid);
	fi_close(&av->fid);
	fi_close(&domain->fid);
	fi_close(&fabric->fid);
	return recv_err == FI_EHOSTUNREACH && send_err == FI_EHOSTUNREACH ? 0 : 1;
}
