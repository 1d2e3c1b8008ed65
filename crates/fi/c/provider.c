/*
 * The lanbus libfabric provider's objects: fabric, domain, address vector, completion queue and
 * RDM endpoint with tagged messages, as libfabric's headers define them. An outside provider gets
 * none of libfabric's internal helpers, so hint matching and every object are here; the
 * messaging itself (matching, eager and rendezvous, progress) is the Rust side's, reached
 * through the lanbus_fi_* functions of src/lib.rs.
 *
 * Written in C because libfabric's ABI is its headers: structures of function-pointer tables
 * whose layout the compiler takes from them.
 */

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <rdma/fabric.h>
#include <rdma/fi_atomic.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_collective.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>
#include <rdma/providers/fi_prov.h>

#define LB_NAME "lanbus"
#define LB_ADDR_LEN 8
#define LB_VERSION FI_VERSION(0, 1)
#define LB_API FI_VERSION(1, 17)
#define LB_MAX_MSG ((size_t)1 << 31)
#define LB_INJECT 16384
#define LB_CQ_DATA 4 /* bytes of remote CQ data: the messaging engine's 32-bit context field */
#define LB_CQ_EPS 16

/* ---- The Rust side (src/lib.rs). ---- */

struct lanbus_ep;

struct lb_completion {
	void *context;
	uint64_t flags;
	size_t len;
	void *buf;
	uint64_t tag;
	uint64_t data;
	size_t olen;
	uint32_t err;
};

enum { LB_ERR_NONE, LB_ERR_TRUNC, LB_ERR_CANCELED, LB_ERR_NOMSG, LB_ERR_PEER, LB_ERR_DAEMON };
enum { LB_RECV_PEEK = 1, LB_RECV_CLAIM = 2, LB_RECV_DISCARD = 4 };

struct lanbus_ep *lanbus_fi_ep_open(char *err, size_t err_len);
void lanbus_fi_ep_close(struct lanbus_ep *ep);
void lanbus_fi_ep_name(const struct lanbus_ep *ep, uint8_t *out);
int lanbus_fi_send(const struct lanbus_ep *ep, const uint8_t *dest, const void *buf, size_t len,
		   uint64_t tag, uint64_t cq_data, void *context, uint64_t flags, bool wanted);
int lanbus_fi_recv(const struct lanbus_ep *ep, const uint8_t *src, void *buf, size_t len,
		   uint64_t tag, uint64_t ignore, void *context, uint64_t flags, bool wanted,
		   uint32_t how);
int lanbus_fi_cancel(const struct lanbus_ep *ep, void *context);
ssize_t lanbus_fi_read(const struct lanbus_ep *ep, struct lb_completion *out, size_t max);
int lanbus_fi_read_error(const struct lanbus_ep *ep, struct lb_completion *out);

/* ---- Operations this provider does not have. ----
 * Each table slot must hold a function; these answer -FI_ENOSYS. They are called through the
 * slot's own pointer type, so each is declared with that type's signature by the macros below.
 */

#define NOSYS(ret, name, ...) \
	static ret name(__VA_ARGS__) { return -FI_ENOSYS; }

NOSYS(int, no_bind, struct fid *f, struct fid *b, uint64_t fl)
NOSYS(int, no_control, struct fid *f, int c, void *a)
NOSYS(int, no_ops_open, struct fid *f, const char *n, uint64_t fl, void **o, void *c)
NOSYS(int, no_tostr, const struct fid *f, char *b, size_t l)
NOSYS(int, no_ops_set, struct fid *f, const char *n, uint64_t fl, void *o, void *c)
NOSYS(int, no_passive_ep, struct fid_fabric *f, struct fi_info *i, struct fid_pep **p, void *c)
NOSYS(int, no_eq_open, struct fid_fabric *f, struct fi_eq_attr *a, struct fid_eq **e, void *c)
NOSYS(int, no_wait_open, struct fid_fabric *f, struct fi_wait_attr *a, struct fid_wait **w)
NOSYS(int, no_trywait, struct fid_fabric *f, struct fid **fs, int n)
NOSYS(int, no_domain2, struct fid_fabric *f, struct fi_info *i, struct fid_domain **d, uint64_t fl, void *c)
NOSYS(int, no_scalable_ep, struct fid_domain *d, struct fi_info *i, struct fid_ep **e, void *c)
NOSYS(int, no_cntr_open, struct fid_domain *d, struct fi_cntr_attr *a, struct fid_cntr **c, void *x)
NOSYS(int, no_poll_open, struct fid_domain *d, struct fi_poll_attr *a, struct fid_poll **p)
NOSYS(int, no_stx_ctx, struct fid_domain *d, struct fi_tx_attr *a, struct fid_stx **s, void *c)
NOSYS(int, no_srx_ctx, struct fid_domain *d, struct fi_rx_attr *a, struct fid_ep **e, void *c)
NOSYS(int, no_query_atomic, struct fid_domain *d, enum fi_datatype t, enum fi_op o, struct fi_atomic_attr *a, uint64_t fl)
NOSYS(int, no_query_collective, struct fid_domain *d, enum fi_collective_op o, struct fi_collective_attr *a, uint64_t fl)
NOSYS(int, no_endpoint2, struct fid_domain *d, struct fi_info *i, struct fid_ep **e, uint64_t fl, void *c)
NOSYS(int, no_mr_reg, struct fid *f, const void *b, size_t l, uint64_t a, uint64_t o, uint64_t k, uint64_t fl, struct fid_mr **m, void *c)
NOSYS(int, no_mr_regv, struct fid *f, const struct iovec *v, size_t n, uint64_t a, uint64_t o, uint64_t k, uint64_t fl, struct fid_mr **m, void *c)
NOSYS(int, no_mr_regattr, struct fid *f, const struct fi_mr_attr *a, uint64_t fl, struct fid_mr **m)
NOSYS(int, no_setname, fid_t f, void *a, size_t l)
NOSYS(int, no_getpeer, struct fid_ep *e, void *a, size_t *l)
NOSYS(int, no_connect, struct fid_ep *e, const void *a, const void *p, size_t l)
NOSYS(int, no_listen, struct fid_pep *p)
NOSYS(int, no_accept, struct fid_ep *e, const void *p, size_t l)
NOSYS(int, no_reject, struct fid_pep *p, fid_t h, const void *x, size_t l)
NOSYS(int, no_shutdown, struct fid_ep *e, uint64_t fl)
NOSYS(int, no_join, struct fid_ep *e, const void *a, uint64_t fl, struct fid_mc **m, void *c)
NOSYS(int, no_tx_ctx, struct fid_ep *s, int i, struct fi_tx_attr *a, struct fid_ep **e, void *c)
NOSYS(int, no_rx_ctx, struct fid_ep *s, int i, struct fi_rx_attr *a, struct fid_ep **e, void *c)
NOSYS(ssize_t, no_msg_recv, struct fid_ep *e, void *b, size_t l, void *d, fi_addr_t s, void *c)
NOSYS(ssize_t, no_msg_recvv, struct fid_ep *e, const struct iovec *v, void **d, size_t n, fi_addr_t s, void *c)
NOSYS(ssize_t, no_msg_recvmsg, struct fid_ep *e, const struct fi_msg *m, uint64_t fl)
NOSYS(ssize_t, no_msg_send, struct fid_ep *e, const void *b, size_t l, void *d, fi_addr_t t, void *c)
NOSYS(ssize_t, no_msg_sendv, struct fid_ep *e, const struct iovec *v, void **d, size_t n, fi_addr_t t, void *c)
NOSYS(ssize_t, no_msg_sendmsg, struct fid_ep *e, const struct fi_msg *m, uint64_t fl)
NOSYS(ssize_t, no_msg_inject, struct fid_ep *e, const void *b, size_t l, fi_addr_t t)
NOSYS(ssize_t, no_msg_senddata, struct fid_ep *e, const void *b, size_t l, void *d, uint64_t x, fi_addr_t t, void *c)
NOSYS(ssize_t, no_msg_injectdata, struct fid_ep *e, const void *b, size_t l, uint64_t x, fi_addr_t t)
NOSYS(int, no_insertsvc, struct fid_av *a, const char *n, const char *s, fi_addr_t *f, uint64_t fl, void *c)
NOSYS(int, no_insertsym, struct fid_av *a, const char *n, size_t nc, const char *s, size_t sc, fi_addr_t *f, uint64_t fl, void *c)
NOSYS(int, no_av_set, struct fid_av *a, struct fi_av_set_attr *s, struct fid_av_set **o, void *c)
NOSYS(int, no_cq_signal, struct fid_cq *c)

static struct fi_ops_msg lb_msg_ops = {
	.size = sizeof(struct fi_ops_msg),
	.recv = no_msg_recv, .recvv = no_msg_recvv, .recvmsg = no_msg_recvmsg,
	.send = no_msg_send, .sendv = no_msg_sendv, .sendmsg = no_msg_sendmsg,
	.inject = no_msg_inject, .senddata = no_msg_senddata, .injectdata = no_msg_injectdata,
};

/*
 * RMA, atomics and collectives: this provider offers none (no FI_RMA, FI_ATOMIC or
 * FI_COLLECTIVE in its capabilities), so an application never reaches these tables. Their slots
 * still hold a function answering -FI_ENOSYS, reached through a cast: a call through the
 * wrong type cannot happen without the application asking for a capability it was not given.
 */
static ssize_t lb_nosys(void) { return -FI_ENOSYS; }
#define NS(type) ((type)(void (*)(void))lb_nosys)

static struct fi_ops_rma lb_rma_ops = {
	.size = sizeof(struct fi_ops_rma),
	.read = NS(ssize_t (*)(struct fid_ep *, void *, size_t, void *, fi_addr_t, uint64_t, uint64_t, void *)),
	.readv = NS(ssize_t (*)(struct fid_ep *, const struct iovec *, void **, size_t, fi_addr_t, uint64_t, uint64_t, void *)),
	.readmsg = NS(ssize_t (*)(struct fid_ep *, const struct fi_msg_rma *, uint64_t)),
	.write = NS(ssize_t (*)(struct fid_ep *, const void *, size_t, void *, fi_addr_t, uint64_t, uint64_t, void *)),
	.writev = NS(ssize_t (*)(struct fid_ep *, const struct iovec *, void **, size_t, fi_addr_t, uint64_t, uint64_t, void *)),
	.writemsg = NS(ssize_t (*)(struct fid_ep *, const struct fi_msg_rma *, uint64_t)),
	.inject = NS(ssize_t (*)(struct fid_ep *, const void *, size_t, fi_addr_t, uint64_t, uint64_t)),
	.writedata = NS(ssize_t (*)(struct fid_ep *, const void *, size_t, void *, uint64_t, fi_addr_t, uint64_t, uint64_t, void *)),
	.injectdata = NS(ssize_t (*)(struct fid_ep *, const void *, size_t, uint64_t, fi_addr_t, uint64_t, uint64_t)),
};

static struct fi_ops_atomic lb_atomic_ops;
static struct fi_ops_collective lb_collective_ops;

static void lb_fill_nosys(void *table, size_t size)
{
	/* Every slot after `size` of a table of function pointers. */
	void (**slot)(void) = (void (**)(void))((char *)table + sizeof(size_t));
	size_t n = (size - sizeof(size_t)) / sizeof(void (*)(void));
	for (size_t i = 0; i < n; i++)
		slot[i] = (void (*)(void))lb_nosys;
	*(size_t *)table = size;
}

/* ---- Objects. ---- */

struct lb_fabric {
	struct fid_fabric fabric;
};

struct lb_domain {
	struct fid_domain domain;
};

struct lb_av {
	struct fid_av av;
	pthread_mutex_t lock;
	uint8_t (*addrs)[LB_ADDR_LEN];
	size_t len, cap;
};

struct lb_ep;

struct lb_cq {
	struct fid_cq cq;
	enum fi_cq_format format;
	pthread_mutex_t lock;
	struct lb_ep *eps[LB_CQ_EPS];
	int neps;
};

struct lb_ep {
	struct fid_ep ep;
	struct lanbus_ep *rs;
	struct lb_av *av;
	struct lb_cq *cq;
	uint64_t tx_op_flags, rx_op_flags;
	bool selective;
};

static uint64_t lb_caps(void)
{
	return FI_TAGGED | FI_SEND | FI_RECV | FI_DIRECTED_RECV | FI_REMOTE_CQ_DATA | FI_LOCAL_COMM |
	       FI_REMOTE_COMM;
}

/* ---- Address vector. ---- */

static int lb_av_close(struct fid *fid)
{
	struct lb_av *av = (struct lb_av *)fid;
	pthread_mutex_destroy(&av->lock);
	free(av->addrs);
	free(av);
	return 0;
}

static int lb_av_insert(struct fid_av *fav, const void *addr, size_t count, fi_addr_t *fi_addr,
			uint64_t flags, void *context)
{
	struct lb_av *av = (struct lb_av *)fav;
	(void)flags;
	(void)context;
	pthread_mutex_lock(&av->lock);
	if (av->len + count > av->cap) {
		size_t cap = av->cap ? av->cap : 64;
		while (cap < av->len + count)
			cap *= 2;
		void *grown = realloc(av->addrs, cap * LB_ADDR_LEN);
		if (!grown) {
			pthread_mutex_unlock(&av->lock);
			return -FI_ENOMEM;
		}
		av->addrs = grown;
		av->cap = cap;
	}
	for (size_t i = 0; i < count; i++) {
		memcpy(av->addrs[av->len], (const uint8_t *)addr + i * LB_ADDR_LEN, LB_ADDR_LEN);
		if (fi_addr)
			fi_addr[i] = av->len;
		av->len++;
	}
	pthread_mutex_unlock(&av->lock);
	return (int)count;
}

static int lb_av_remove(struct fid_av *fav, fi_addr_t *fi_addr, size_t count, uint64_t flags)
{
	/* Entries stay (indices are not reused); what is sent to them fails at the peer. */
	(void)fav;
	(void)fi_addr;
	(void)count;
	(void)flags;
	return 0;
}

/* Copies entry `a` into `out`; false if there is no such entry. */
static bool lb_av_get(struct lb_av *av, fi_addr_t a, uint8_t out[LB_ADDR_LEN])
{
	bool ok;
	pthread_mutex_lock(&av->lock);
	ok = a < av->len;
	if (ok)
		memcpy(out, av->addrs[a], LB_ADDR_LEN);
	pthread_mutex_unlock(&av->lock);
	return ok;
}

static int lb_av_lookup(struct fid_av *fav, fi_addr_t fi_addr, void *addr, size_t *addrlen)
{
	uint8_t a[LB_ADDR_LEN];
	if (!lb_av_get((struct lb_av *)fav, fi_addr, a))
		return -FI_EINVAL;
	memcpy(addr, a, *addrlen < LB_ADDR_LEN ? *addrlen : LB_ADDR_LEN);
	*addrlen = LB_ADDR_LEN;
	return 0;
}

static const char *lb_av_straddr(struct fid_av *fav, const void *addr, char *buf, size_t *len)
{
	const uint8_t *a = addr;
	char s[48];
	(void)fav;
	int n = snprintf(s, sizeof(s), "lanbus://%02x:%02x:%02x:%02x:%02x:%02x/%u", a[0], a[1], a[2],
			 a[3], a[4], a[5], (unsigned)(a[6] | a[7] << 8));
	if (*len > 0) {
		snprintf(buf, *len, "%s", s);
	}
	*len = (size_t)n + 1;
	return buf;
}

static struct fi_ops lb_av_fi_ops = {
	.size = sizeof(struct fi_ops), .close = lb_av_close, .bind = no_bind,
	.control = no_control, .ops_open = no_ops_open, .tostr = no_tostr, .ops_set = no_ops_set,
};

static struct fi_ops_av lb_av_ops = {
	.size = sizeof(struct fi_ops_av), .insert = lb_av_insert, .insertsvc = no_insertsvc,
	.insertsym = no_insertsym, .remove = lb_av_remove, .lookup = lb_av_lookup,
	.straddr = lb_av_straddr, .av_set = no_av_set,
};

static int lb_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **out,
		      void *context)
{
	struct lb_av *av;
	if (attr && attr->type != FI_AV_UNSPEC && attr->type != FI_AV_MAP && attr->type != FI_AV_TABLE)
		return -FI_EINVAL;
	if (attr && (attr->flags & (FI_EVENT | FI_SYMMETRIC)))
		return -FI_ENOSYS;
	av = calloc(1, sizeof(*av));
	if (!av)
		return -FI_ENOMEM;
	pthread_mutex_init(&av->lock, NULL);
	av->av.fid.fclass = FI_CLASS_AV;
	av->av.fid.context = context;
	av->av.fid.ops = &lb_av_fi_ops;
	av->av.ops = &lb_av_ops;
	(void)domain;
	*out = &av->av;
	return 0;
}

/* ---- Completion queue. ---- */

static int lb_cq_close(struct fid *fid)
{
	struct lb_cq *cq = (struct lb_cq *)fid;
	if (cq->neps > 0)
		return -FI_EBUSY;
	pthread_mutex_destroy(&cq->lock);
	free(cq);
	return 0;
}

static size_t lb_entry_size(enum fi_cq_format f)
{
	switch (f) {
	case FI_CQ_FORMAT_CONTEXT: return sizeof(struct fi_cq_entry);
	case FI_CQ_FORMAT_MSG: return sizeof(struct fi_cq_msg_entry);
	case FI_CQ_FORMAT_DATA: return sizeof(struct fi_cq_data_entry);
	default: return sizeof(struct fi_cq_tagged_entry);
	}
}

static void lb_write_entry(enum fi_cq_format f, void *dst, const struct lb_completion *c)
{
	switch (f) {
	case FI_CQ_FORMAT_CONTEXT: {
		struct fi_cq_entry *e = dst;
		e->op_context = c->context;
		break;
	}
	case FI_CQ_FORMAT_MSG: {
		struct fi_cq_msg_entry *e = dst;
		e->op_context = c->context, e->flags = c->flags, e->len = c->len;
		break;
	}
	case FI_CQ_FORMAT_DATA: {
		struct fi_cq_data_entry *e = dst;
		e->op_context = c->context, e->flags = c->flags, e->len = c->len;
		e->buf = c->buf, e->data = c->data;
		break;
	}
	default: {
		struct fi_cq_tagged_entry *e = dst;
		e->op_context = c->context, e->flags = c->flags, e->len = c->len;
		e->buf = c->buf, e->data = c->data, e->tag = c->tag;
		break;
	}
	}
}

static ssize_t lb_cq_read(struct fid_cq *fcq, void *buf, size_t count)
{
	struct lb_cq *cq = (struct lb_cq *)fcq;
	struct lb_completion got[64];
	size_t done = 0, size = lb_entry_size(cq->format);
	bool error = false;

	pthread_mutex_lock(&cq->lock);
	for (int i = 0; i < cq->neps && done < count; i++) {
		size_t want = count - done < 64 ? count - done : 64;
		ssize_t n = lanbus_fi_read(cq->eps[i]->rs, got, want);
		if (n < 0) {
			error = true;
			continue;
		}
		for (ssize_t k = 0; k < n; k++)
			lb_write_entry(cq->format, (char *)buf + (done + k) * size, &got[k]);
		done += n;
	}
	pthread_mutex_unlock(&cq->lock);
	if (done > 0)
		return done;
	return error ? -FI_EAVAIL : -FI_EAGAIN;
}

static ssize_t lb_cq_readfrom(struct fid_cq *cq, void *buf, size_t count, fi_addr_t *src)
{
	ssize_t n = lb_cq_read(cq, buf, count);
	for (ssize_t i = 0; src && i < n; i++)
		src[i] = FI_ADDR_NOTAVAIL;
	return n;
}

static int lb_errno(uint32_t kind)
{
	switch (kind) {
	case LB_ERR_TRUNC: return FI_ETRUNC;
	case LB_ERR_CANCELED: return FI_ECANCELED;
	case LB_ERR_NOMSG: return FI_ENOMSG;
	case LB_ERR_PEER: return FI_EHOSTUNREACH;
	default: return FI_EIO;
	}
}

static ssize_t lb_cq_readerr(struct fid_cq *fcq, struct fi_cq_err_entry *buf, uint64_t flags)
{
	struct lb_cq *cq = (struct lb_cq *)fcq;
	struct lb_completion c;
	(void)flags;
	pthread_mutex_lock(&cq->lock);
	for (int i = 0; i < cq->neps; i++) {
		if (lanbus_fi_read_error(cq->eps[i]->rs, &c)) {
			pthread_mutex_unlock(&cq->lock);
			buf->op_context = c.context;
			buf->flags = c.flags;
			buf->len = c.len;
			buf->buf = c.buf;
			buf->data = c.data;
			buf->tag = c.tag;
			buf->olen = c.olen;
			buf->err = lb_errno(c.err);
			buf->prov_errno = (int)c.err;
			buf->err_data = NULL;
			buf->err_data_size = 0;
			return 1;
		}
	}
	pthread_mutex_unlock(&cq->lock);
	return -FI_EAGAIN;
}

static ssize_t lb_cq_sreadfrom(struct fid_cq *cq, void *buf, size_t count, fi_addr_t *src,
			       const void *cond, int timeout_ms)
{
	struct timespec start, now;
	(void)cond;
	clock_gettime(CLOCK_MONOTONIC, &start);
	for (;;) {
		ssize_t n = lb_cq_readfrom(cq, buf, count, src);
		if (n != -FI_EAGAIN)
			return n;
		clock_gettime(CLOCK_MONOTONIC, &now);
		long ms = (now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
		if (timeout_ms >= 0 && ms >= timeout_ms)
			return -FI_EAGAIN;
		sched_yield();
	}
}

static ssize_t lb_cq_sread(struct fid_cq *cq, void *buf, size_t count, const void *cond, int timeout)
{
	return lb_cq_sreadfrom(cq, buf, count, NULL, cond, timeout);
}

static const char *lb_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data,
				  char *buf, size_t len)
{
	static const char *why[] = {
		"no error", "message longer than the receive buffer", "receive cancelled",
		"no matching message", "the peer went down, restarted or went away",
		"the lanbus messaging daemon went away",
	};
	const char *s = prov_errno >= 0 && prov_errno <= LB_ERR_DAEMON ? why[prov_errno] : "unknown";
	(void)cq;
	(void)err_data;
	if (buf && len > 0) {
		snprintf(buf, len, "%s", s);
		return buf;
	}
	return s;
}

static struct fi_ops lb_cq_fi_ops = {
	.size = sizeof(struct fi_ops), .close = lb_cq_close, .bind = no_bind,
	.control = no_control, .ops_open = no_ops_open, .tostr = no_tostr, .ops_set = no_ops_set,
};

static struct fi_ops_cq lb_cq_ops = {
	.size = sizeof(struct fi_ops_cq), .read = lb_cq_read, .readfrom = lb_cq_readfrom,
	.readerr = lb_cq_readerr, .sread = lb_cq_sread, .sreadfrom = lb_cq_sreadfrom,
	.signal = no_cq_signal, .strerror = lb_cq_strerror,
};

static int lb_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **out,
		      void *context)
{
	struct lb_cq *cq;
	(void)domain;
	if (attr && attr->wait_obj != FI_WAIT_NONE && attr->wait_obj != FI_WAIT_UNSPEC)
		return -FI_ENOSYS;
	if (attr && attr->format > FI_CQ_FORMAT_TAGGED)
		return -FI_EINVAL;
	cq = calloc(1, sizeof(*cq));
	if (!cq)
		return -FI_ENOMEM;
	pthread_mutex_init(&cq->lock, NULL);
	cq->format = attr && attr->format != FI_CQ_FORMAT_UNSPEC ? attr->format : FI_CQ_FORMAT_TAGGED;
	cq->cq.fid.fclass = FI_CLASS_CQ;
	cq->cq.fid.context = context;
	cq->cq.fid.ops = &lb_cq_fi_ops;
	cq->cq.ops = &lb_cq_ops;
	*out = &cq->cq;
	return 0;
}

/* ---- Endpoint. ---- */

static int lb_ep_close(struct fid *fid)
{
	struct lb_ep *ep = (struct lb_ep *)fid;
	if (ep->cq) {
		struct lb_cq *cq = ep->cq;
		pthread_mutex_lock(&cq->lock);
		for (int i = 0; i < cq->neps; i++) {
			if (cq->eps[i] == ep) {
				cq->eps[i] = cq->eps[--cq->neps];
				break;
			}
		}
		pthread_mutex_unlock(&cq->lock);
	}
	lanbus_fi_ep_close(ep->rs);
	free(ep);
	return 0;
}

static int lb_ep_bind(struct fid *fid, struct fid *bfid, uint64_t flags)
{
	struct lb_ep *ep = (struct lb_ep *)fid;
	switch (bfid->fclass) {
	case FI_CLASS_AV:
		if (ep->av)
			return -FI_EINVAL;
		ep->av = (struct lb_av *)bfid;
		return 0;
	case FI_CLASS_CQ: {
		struct lb_cq *cq = (struct lb_cq *)bfid;
		if (ep->cq && ep->cq != cq) {
			fprintf(stderr, "lanbus provider: an endpoint's sends and receives complete in one CQ\n");
			return -FI_ENOSYS;
		}
		if (flags & FI_SELECTIVE_COMPLETION)
			ep->selective = true;
		if (ep->cq)
			return 0;
		pthread_mutex_lock(&cq->lock);
		if (cq->neps == LB_CQ_EPS) {
			pthread_mutex_unlock(&cq->lock);
			return -FI_ENOSPC;
		}
		cq->eps[cq->neps++] = ep;
		pthread_mutex_unlock(&cq->lock);
		ep->cq = cq;
		return 0;
	}
	default:
		return -FI_ENOSYS;
	}
}

static int lb_ep_control(struct fid *fid, int command, void *arg)
{
	struct lb_ep *ep = (struct lb_ep *)fid;
	(void)arg;
	switch (command) {
	case FI_ENABLE:
		return ep->cq && ep->av ? 0 : -FI_ENOCQ;
	default:
		return -FI_ENOSYS;
	}
}

static int lb_getname(fid_t fid, void *addr, size_t *addrlen)
{
	struct lb_ep *ep = (struct lb_ep *)fid;
	uint8_t a[LB_ADDR_LEN];
	size_t room = *addrlen;
	lanbus_fi_ep_name(ep->rs, a);
	*addrlen = LB_ADDR_LEN;
	if (room < LB_ADDR_LEN)
		return -FI_ETOOSMALL;
	memcpy(addr, a, LB_ADDR_LEN);
	return 0;
}

static ssize_t lb_ep_cancel(fid_t fid, void *context)
{
	struct lb_ep *ep = (struct lb_ep *)fid;
	return lanbus_fi_cancel(ep->rs, context) == 0 ? 0 : -FI_ENOENT;
}

static int lb_getopt(fid_t fid, int level, int name, void *val, size_t *len)
{
	(void)fid, (void)level, (void)name, (void)val, (void)len;
	return -FI_ENOPROTOOPT;
}

static int lb_setopt(fid_t fid, int level, int name, const void *val, size_t len)
{
	(void)fid, (void)level, (void)name, (void)val, (void)len;
	return -FI_ENOPROTOOPT;
}

static ssize_t lb_size_left(struct fid_ep *ep)
{
	(void)ep;
	return 1 << 20;
}

/* The peer's address for `a`, or null for any source; false if `a` is not in the AV. */
static bool lb_peer(struct lb_ep *ep, fi_addr_t a, uint8_t out[LB_ADDR_LEN], const uint8_t **p)
{
	if (a == FI_ADDR_UNSPEC) {
		*p = NULL;
		return true;
	}
	if (!ep->av || !lb_av_get(ep->av, a, out))
		return false;
	*p = out;
	return true;
}

static ssize_t lb_do_recv(struct lb_ep *ep, void *buf, size_t len, fi_addr_t src, uint64_t tag,
			  uint64_t ignore, void *context, uint64_t flags)
{
	uint8_t a[LB_ADDR_LEN];
	const uint8_t *p;
	uint32_t how = 0;
	if (!lb_peer(ep, src, a, &p))
		return -FI_EINVAL;
	if (flags & FI_PEEK)
		how |= LB_RECV_PEEK;
	if (flags & FI_CLAIM)
		how |= LB_RECV_CLAIM;
	if (flags & FI_DISCARD)
		how |= LB_RECV_DISCARD;
	bool wanted = !ep->selective || (flags & FI_COMPLETION) || (how & LB_RECV_PEEK);
	if (lanbus_fi_recv(ep->rs, p, buf, len, tag, ignore, context,
			   FI_TAGGED | FI_RECV | FI_REMOTE_CQ_DATA, wanted, how))
		return -FI_EINVAL;
	return 0;
}

static ssize_t lb_do_send(struct lb_ep *ep, const void *buf, size_t len, fi_addr_t dest,
			  uint64_t tag, uint64_t data, void *context, uint64_t flags, bool inject)
{
	uint8_t a[LB_ADDR_LEN];
	const uint8_t *p;
	if (dest == FI_ADDR_UNSPEC || !lb_peer(ep, dest, a, &p))
		return -FI_EINVAL;
	if (len > LB_MAX_MSG || (inject && len > LB_INJECT))
		return -FI_EMSGSIZE;
	bool wanted = !inject && (!ep->selective || (flags & FI_COMPLETION));
	if (data >> (8 * LB_CQ_DATA))
		return -FI_EINVAL;
	if (lanbus_fi_send(ep->rs, p, buf, len, tag, data, inject ? NULL : context,
			   FI_TAGGED | FI_SEND, wanted))
		return -FI_EINVAL;
	return 0;
}

static ssize_t lb_trecv(struct fid_ep *fep, void *buf, size_t len, void *desc, fi_addr_t src,
			uint64_t tag, uint64_t ignore, void *context)
{
	struct lb_ep *ep = (struct lb_ep *)fep;
	(void)desc;
	return lb_do_recv(ep, buf, len, src, tag, ignore, context, ep->rx_op_flags);
}

static ssize_t lb_trecvv(struct fid_ep *fep, const struct iovec *iov, void **desc, size_t count,
			 fi_addr_t src, uint64_t tag, uint64_t ignore, void *context)
{
	if (count > 1)
		return -FI_EINVAL;
	return lb_trecv(fep, count ? iov[0].iov_base : NULL, count ? iov[0].iov_len : 0,
			desc ? desc[0] : NULL, src, tag, ignore, context);
}

static ssize_t lb_trecvmsg(struct fid_ep *fep, const struct fi_msg_tagged *msg, uint64_t flags)
{
	struct lb_ep *ep = (struct lb_ep *)fep;
	if (msg->iov_count > 1)
		return -FI_EINVAL;
	return lb_do_recv(ep, msg->iov_count ? msg->msg_iov[0].iov_base : NULL,
			  msg->iov_count ? msg->msg_iov[0].iov_len : 0, msg->addr, msg->tag,
			  msg->ignore, msg->context, flags);
}

static ssize_t lb_tsend(struct fid_ep *fep, const void *buf, size_t len, void *desc,
			fi_addr_t dest, uint64_t tag, void *context)
{
	struct lb_ep *ep = (struct lb_ep *)fep;
	(void)desc;
	return lb_do_send(ep, buf, len, dest, tag, 0, context, ep->tx_op_flags, false);
}

static ssize_t lb_tsendv(struct fid_ep *fep, const struct iovec *iov, void **desc, size_t count,
			 fi_addr_t dest, uint64_t tag, void *context)
{
	if (count > 1)
		return -FI_EINVAL;
	return lb_tsend(fep, count ? iov[0].iov_base : NULL, count ? iov[0].iov_len : 0,
			desc ? desc[0] : NULL, dest, tag, context);
}

static ssize_t lb_tsendmsg(struct fid_ep *fep, const struct fi_msg_tagged *msg, uint64_t flags)
{
	struct lb_ep *ep = (struct lb_ep *)fep;
	if (msg->iov_count > 1)
		return -FI_EINVAL;
	return lb_do_send(ep, msg->iov_count ? msg->msg_iov[0].iov_base : NULL,
			  msg->iov_count ? msg->msg_iov[0].iov_len : 0, msg->addr, msg->tag,
			  (flags & FI_REMOTE_CQ_DATA) ? msg->data : 0, msg->context, flags, false);
}

static ssize_t lb_tinject(struct fid_ep *fep, const void *buf, size_t len, fi_addr_t dest,
			  uint64_t tag)
{
	return lb_do_send((struct lb_ep *)fep, buf, len, dest, tag, 0, NULL, 0, true);
}

static ssize_t lb_tsenddata(struct fid_ep *fep, const void *buf, size_t len, void *desc,
			    uint64_t data, fi_addr_t dest, uint64_t tag, void *context)
{
	struct lb_ep *ep = (struct lb_ep *)fep;
	(void)desc;
	return lb_do_send(ep, buf, len, dest, tag, data, context, ep->tx_op_flags, false);
}

static ssize_t lb_tinjectdata(struct fid_ep *fep, const void *buf, size_t len, uint64_t data,
			      fi_addr_t dest, uint64_t tag)
{
	return lb_do_send((struct lb_ep *)fep, buf, len, dest, tag, data, NULL, 0, true);
}

static struct fi_ops lb_ep_fi_ops = {
	.size = sizeof(struct fi_ops), .close = lb_ep_close, .bind = lb_ep_bind,
	.control = lb_ep_control, .ops_open = no_ops_open, .tostr = no_tostr, .ops_set = no_ops_set,
};

static struct fi_ops_ep lb_ep_ops = {
	.size = sizeof(struct fi_ops_ep), .cancel = lb_ep_cancel, .getopt = lb_getopt,
	.setopt = lb_setopt, .tx_ctx = no_tx_ctx, .rx_ctx = no_rx_ctx,
	.rx_size_left = lb_size_left, .tx_size_left = lb_size_left,
};

static struct fi_ops_cm lb_cm_ops = {
	.size = sizeof(struct fi_ops_cm), .setname = no_setname, .getname = lb_getname,
	.getpeer = no_getpeer, .connect = no_connect, .listen = no_listen, .accept = no_accept,
	.reject = no_reject, .shutdown = no_shutdown, .join = no_join,
};

static struct fi_ops_tagged lb_tagged_ops = {
	.size = sizeof(struct fi_ops_tagged), .recv = lb_trecv, .recvv = lb_trecvv,
	.recvmsg = lb_trecvmsg, .send = lb_tsend, .sendv = lb_tsendv, .sendmsg = lb_tsendmsg,
	.inject = lb_tinject, .senddata = lb_tsenddata, .injectdata = lb_tinjectdata,
};

static int lb_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **out,
		       void *context)
{
	char why[512] = "";
	struct lb_ep *ep;
	(void)domain;
	if (info && info->ep_attr && info->ep_attr->type != FI_EP_RDM &&
	    info->ep_attr->type != FI_EP_UNSPEC)
		return -FI_EINVAL;
	ep = calloc(1, sizeof(*ep));
	if (!ep)
		return -FI_ENOMEM;
	ep->rs = lanbus_fi_ep_open(why, sizeof(why));
	if (!ep->rs) {
		fprintf(stderr, "lanbus provider: cannot open an endpoint: %s\n", why);
		free(ep);
		return -FI_ENODEV;
	}
	ep->tx_op_flags = info && info->tx_attr ? info->tx_attr->op_flags : FI_COMPLETION;
	ep->rx_op_flags = info && info->rx_attr ? info->rx_attr->op_flags : FI_COMPLETION;
	ep->ep.fid.fclass = FI_CLASS_EP;
	ep->ep.fid.context = context;
	ep->ep.fid.ops = &lb_ep_fi_ops;
	ep->ep.ops = &lb_ep_ops;
	ep->ep.cm = &lb_cm_ops;
	ep->ep.msg = &lb_msg_ops;
	ep->ep.rma = &lb_rma_ops;
	ep->ep.tagged = &lb_tagged_ops;
	ep->ep.atomic = &lb_atomic_ops;
	ep->ep.collective = &lb_collective_ops;
	*out = &ep->ep;
	return 0;
}

/* ---- Domain and fabric. ---- */

static int lb_close_free(struct fid *fid)
{
	free(fid);
	return 0;
}

static struct fi_ops lb_plain_fi_ops = {
	.size = sizeof(struct fi_ops), .close = lb_close_free, .bind = no_bind,
	.control = no_control, .ops_open = no_ops_open, .tostr = no_tostr, .ops_set = no_ops_set,
};

static struct fi_ops_domain lb_domain_ops = {
	.size = sizeof(struct fi_ops_domain), .av_open = lb_av_open, .cq_open = lb_cq_open,
	.endpoint = lb_endpoint, .scalable_ep = no_scalable_ep, .cntr_open = no_cntr_open,
	.poll_open = no_poll_open, .stx_ctx = no_stx_ctx, .srx_ctx = no_srx_ctx,
	.query_atomic = no_query_atomic, .query_collective = no_query_collective,
	.endpoint2 = no_endpoint2,
};

static struct fi_ops_mr lb_mr_ops = {
	.size = sizeof(struct fi_ops_mr), .reg = no_mr_reg, .regv = no_mr_regv,
	.regattr = no_mr_regattr,
};

static int lb_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **out,
		     void *context)
{
	struct lb_domain *d;
	(void)fabric;
	if (info && info->domain_attr && info->domain_attr->name &&
	    strcmp(info->domain_attr->name, LB_NAME) != 0)
		return -FI_EINVAL;
	d = calloc(1, sizeof(*d));
	if (!d)
		return -FI_ENOMEM;
	d->domain.fid.fclass = FI_CLASS_DOMAIN;
	d->domain.fid.context = context;
	d->domain.fid.ops = &lb_plain_fi_ops;
	d->domain.ops = &lb_domain_ops;
	d->domain.mr = &lb_mr_ops;
	*out = &d->domain;
	return 0;
}

static struct fi_ops_fabric lb_fabric_ops = {
	.size = sizeof(struct fi_ops_fabric), .domain = lb_domain, .passive_ep = no_passive_ep,
	.eq_open = no_eq_open, .wait_open = no_wait_open, .trywait = no_trywait,
	.domain2 = no_domain2,
};

static int lb_fabric(struct fi_fabric_attr *attr, struct fid_fabric **out, void *context)
{
	struct lb_fabric *f;
	if (attr && attr->name && strcmp(attr->name, LB_NAME) != 0)
		return -FI_EINVAL;
	f = calloc(1, sizeof(*f));
	if (!f)
		return -FI_ENOMEM;
	f->fabric.fid.fclass = FI_CLASS_FABRIC;
	f->fabric.fid.context = context;
	f->fabric.fid.ops = &lb_plain_fi_ops;
	f->fabric.ops = &lb_fabric_ops;
	*out = &f->fabric;
	return 0;
}

/* ---- What the provider offers, and matching it against an application's hints. ---- */

static bool lb_name_ok(const char *asked)
{
	return !asked || strcmp(asked, LB_NAME) == 0;
}

/* Whether the hints ask only for what this provider has. */
static bool lb_hints_ok(const struct fi_info *h)
{
	if (!h)
		return true;
	if (h->caps & ~lb_caps())
		return false;
	if (h->ep_attr && h->ep_attr->type != FI_EP_UNSPEC && h->ep_attr->type != FI_EP_RDM)
		return false;
	if (h->addr_format != FI_FORMAT_UNSPEC)
		return false;
	if (h->fabric_attr && !lb_name_ok(h->fabric_attr->name))
		return false;
	if (h->domain_attr) {
		const struct fi_domain_attr *d = h->domain_attr;
		if (!lb_name_ok(d->name) || d->cq_data_size > LB_CQ_DATA)
			return false;
		if (d->av_type != FI_AV_UNSPEC && d->av_type != FI_AV_MAP && d->av_type != FI_AV_TABLE)
			return false;
	}
	if (h->tx_attr && (h->tx_attr->caps & ~lb_caps()))
		return false;
	if (h->rx_attr && (h->rx_attr->caps & ~lb_caps()))
		return false;
	/* Ordering: one tag's messages between a pair stay in order (send after send). */
	if (h->tx_attr && (h->tx_attr->msg_order & ~(uint64_t)FI_ORDER_SAS))
		return false;
	if (h->rx_attr && (h->rx_attr->msg_order & ~(uint64_t)FI_ORDER_SAS))
		return false;
	return true;
}

static int lb_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
		      const struct fi_info *hints, struct fi_info **out)
{
	struct fi_info *info;
	(void)version, (void)node, (void)service, (void)flags;
	*out = NULL;
	if (!lb_hints_ok(hints))
		return -FI_ENODATA;
	info = fi_allocinfo();
	if (!info)
		return -FI_ENOMEM;
	info->caps = lb_caps();
	info->mode = 0;
	info->addr_format = FI_FORMAT_UNSPEC;

	info->tx_attr->caps = lb_caps();
	info->tx_attr->op_flags = hints && hints->tx_attr ? hints->tx_attr->op_flags : 0;
	info->tx_attr->msg_order = FI_ORDER_SAS;
	info->tx_attr->comp_order = FI_ORDER_NONE;
	info->tx_attr->inject_size = LB_INJECT;
	info->tx_attr->size = 1 << 16;
	info->tx_attr->iov_limit = 1;

	info->rx_attr->caps = lb_caps();
	info->rx_attr->op_flags = hints && hints->rx_attr ? hints->rx_attr->op_flags : 0;
	info->rx_attr->msg_order = FI_ORDER_SAS;
	info->rx_attr->comp_order = FI_ORDER_NONE;
	info->rx_attr->size = 1 << 16;
	info->rx_attr->iov_limit = 1;

	info->ep_attr->type = FI_EP_RDM;
	info->ep_attr->protocol = FI_PROTO_UNSPEC;
	info->ep_attr->max_msg_size = LB_MAX_MSG;
	info->ep_attr->mem_tag_format = ~0ULL; /* all 64 tag bits are the application's */
	info->ep_attr->tx_ctx_cnt = 1;
	info->ep_attr->rx_ctx_cnt = 1;

	info->domain_attr->name = strdup(LB_NAME);
	info->domain_attr->threading = FI_THREAD_SAFE;
	info->domain_attr->control_progress = FI_PROGRESS_MANUAL;
	info->domain_attr->data_progress = FI_PROGRESS_MANUAL;
	info->domain_attr->resource_mgmt = FI_RM_ENABLED;
	info->domain_attr->av_type =
		hints && hints->domain_attr && hints->domain_attr->av_type != FI_AV_UNSPEC
			? hints->domain_attr->av_type : FI_AV_TABLE;
	info->domain_attr->mr_mode = 0;
	info->domain_attr->cq_data_size = LB_CQ_DATA;
	info->domain_attr->cq_cnt = 64;
	info->domain_attr->ep_cnt = 64;
	info->domain_attr->tx_ctx_cnt = 64;
	info->domain_attr->rx_ctx_cnt = 64;
	info->domain_attr->max_ep_tx_ctx = 1;
	info->domain_attr->max_ep_rx_ctx = 1;

	info->fabric_attr->name = strdup(LB_NAME);
	if (!info->domain_attr->name || !info->fabric_attr->name) {
		fi_freeinfo(info);
		return -FI_ENOMEM;
	}
	*out = info;
	return 0;
}

static void lb_cleanup(void) {}

static struct fi_provider lb_provider = {
	.version = LB_VERSION,
	.fi_version = LB_API,
	.name = LB_NAME,
	.getinfo = lb_getinfo,
	.fabric = lb_fabric,
	.cleanup = lb_cleanup,
};

/* Called by fi_prov_ini (exported from src/lib.rs). */
struct fi_provider *lanbus_fi_provider(void)
{
	lb_fill_nosys(&lb_atomic_ops, sizeof(lb_atomic_ops));
	lb_fill_nosys(&lb_collective_ops, sizeof(lb_collective_ops));
	return &lb_provider;
}
