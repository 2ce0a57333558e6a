/* The fetch job's daemon: see daemon.h. */
#include "daemon.h"

#include <poll.h>
#include <sys/socket.h>
#include "frame.h"
#include "staging_gate.h"
#include "reader.h"
#include "writer.h"



void daemon_drop(core_t *c, const char *why) {
    if (c->sock >= 0 && hung_up(c->sock)) c->peer_hup_ns = now_ns();  /* a writer's end (writer.h) */
    if (c->sock >= 0) close(c->sock);
    c->sock = -1;
    c->pending_id = 0;
    c->split = 0;
    atomic_fetch_add(&c->drops, 1);
    set_text(c, c->note, "layer %d: the daemon connection was dropped (%s); rows are read from the table files "
             "until it is back", c->layer, why);
}

/* 0, or -ETIMEDOUT / -errno / -EPIPE (peer closed) */
static int io_all(int fd, void *buf, size_t n, int64_t deadline, int sending) {
    size_t done = 0;
    while (done < n) {
        ssize_t r = sending ? send(fd, (char *)buf + done, n - done, MSG_NOSIGNAL | MSG_DONTWAIT)
                            : recv(fd, (char *)buf + done, n - done, MSG_DONTWAIT);
        if (r > 0) { done += (size_t)r; continue; }
        if (r == 0) return -EPIPE;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
        int64_t left = deadline - now_ns();
        if (left <= 0) return -ETIMEDOUT;
        struct pollfd p = {.fd = fd, .events = sending ? POLLOUT : POLLIN};
        int ms = (int)((left + 999999) / 1000000);
        if (poll(&p, 1, ms) < 0 && errno != EINTR) return -errno;
    }
    return 0;
}

static const char *transport_why(int rc) {
    return rc == -ETIMEDOUT ? "no answer within the deadline" : rc == -EPIPE ? "it closed the connection" : strerror(-rc);
}

/* A RESULT frame for request `want` and its payload (an error message, kept in msg): 0, or -1 dropped. */
static int read_frame(core_t *c, uint64_t want, int64_t deadline, frame_t *r, char *msg) {
    int rc = io_all(c->sock, r, sizeof *r, deadline, 0);
    if (rc != 0) {
        daemon_drop(c, transport_why(rc));
        return -1;
    }
    if (r->magic != MAGIC || r->version != VERSION || r->op != OP_RESULT || r->request_id != want ||
        r->payload_bytes > MAX_DAEMON_PAYLOAD) {
        daemon_drop(c, "a frame that is not the answer");
        return -1;
    }
    msg[0] = 0;
    if (r->payload_bytes) {  /* an error message: keep the first MSG_BYTES - 1 bytes */
        char sink[4096];
        uint32_t keep = r->payload_bytes < MSG_BYTES - 1 ? r->payload_bytes : MSG_BYTES - 1, left = r->payload_bytes - keep;
        rc = io_all(c->sock, msg, keep, deadline, 0);
        msg[rc == 0 ? keep : 0] = 0;
        while (rc == 0 && left) {
            uint32_t n = left < sizeof sink ? left : (uint32_t)sizeof sink;
            rc = io_all(c->sock, sink, n, deadline, 0);
            left -= n;
        }
        if (rc != 0) {
            daemon_drop(c, "its answer was cut short");
            return -1;
        }
    }
    return 0;
}

int settle_pending(core_t *c, int64_t now) {
    struct pollfd p = {.fd = c->sock, .events = POLLIN};
    if (poll(&p, 1, 0) > 0) {
        frame_t r;
        char msg[MSG_BYTES];
        if (read_frame(c, c->pending_id, now + LATE_FRAME_NS, &r, msg) < 0) return 0;
        c->pending_id = 0;
        atomic_fetch_add(&c->late_answers, 1);
        return 1;
    }
    if (now - c->pending_since > c->deadline_ns) daemon_drop(c, "no answer within the deadline");
    return 0;
}

int daemon_usable(core_t *c, int64_t now, int backoff) {
    if (c->sock < 0) return 0;
    if (c->pending_id && !settle_pending(c, now)) {
        if (c->sock >= 0) atomic_fetch_add(&c->busy_steps, 1);
        return 0;
    }
    if (backoff && now < c->backoff_until && reader_idle(c)) {  /* (with direct reads busy, the daemon is asked anyway) */
        atomic_fetch_add(&c->backoff_steps, 1);
        return 0;
    }
    return 1;
}

int send_request(core_t *c, int64_t m, int64_t n) {
    const int64_t ids_n = c->split ? n : m;
    if (c->ids_off + ids_n * 8 > c->region_len || (!c->split && c->out_off + m * c->row_bytes > c->region_len)) {
        set_text(c, c->note, "layer %d: %lld rows do not fit the shared region", c->layer, (long long)m);
        return -1;
    }
    int64_t *ids = (int64_t *)(c->region + c->ids_off);
    if (c->split) {  /* every position; the daemon leaves PAD_ID ones alone (zeroed by the run) */
        for (int64_t i = 0; i < n; i++) {
            const int64_t id = c->ids[i];
            ids[i] = id >= 0 && id < c->layer_rows ? id : SPLIT_PAD_ID;
        }
        gate_open(c->gate, c->request_id + 1);
    } else {
        for (int64_t k = 0; k < m; k++) ids[k] = c->ids[c->pos[k]];
    }
    frame_t f = {.magic = MAGIC, .version = VERSION, .op = OP_LOOKUP, .dtype = DTYPE_INT64, .layer = c->layer,
                 .flags = c->split ? FLAG_SPLIT : 0, .request_id = ++c->request_id, .count = (uint64_t)ids_n,
                 .ids_offset = (uint64_t)c->ids_off, .out_offset = c->split ? 0 : (uint64_t)c->out_off};
    int rc = io_all(c->sock, &f, sizeof f, now_ns() + c->deadline_ns, 1);
    if (rc != 0) {
        daemon_drop(c, transport_why(rc));
        return -1;
    }
    return 0;
}

int read_answer(core_t *c, int64_t deadline) {
    frame_t r;
    char msg[MSG_BYTES];
    if (read_frame(c, c->request_id, deadline, &r, msg) < 0) return -1;
    if (r.status) {
        set_text(c, c->note, "layer %d: the daemon answered status %u: %s", c->layer, r.status, msg);
        atomic_fetch_add(&c->daemon_errors, 1);
        return 0;
    }
    return 1;
}

int64_t hedge_budget(core_t *c) {
    if (c->hedge_fixed_ns > 0) return c->hedge_fixed_ns;
    int64_t cap = c->deadline_ns / 4 < HEDGE_CAP_NS ? c->deadline_ns / 4 : HEDGE_CAP_NS;
    if (c->nlat < HEDGE_WARMUP) return cap;
    /* p99 of n answers: the k-th largest, k = n - ceil(0.99 n) + 1 (1 up to 100 answers, 2 up to 128) */
    int64_t first = 0, second = 0;
    for (int i = 0; i < c->nlat; i++) {
        if (c->lat[i] > first) second = first, first = c->lat[i];
        else if (c->lat[i] > second) second = c->lat[i];
    }
    const int64_t p99 = c->nlat > 100 ? second : first, budget = HEDGE_FLOOR_NS + HEDGE_MULT * p99;
    return budget < cap ? budget : cap;
}

void daemon_answered(core_t *c, int64_t latency_ns, int in_budget) {
    c->lat[c->lat_next] = latency_ns;
    c->lat_next = (c->lat_next + 1) % LAT_RING;
    if (c->nlat < LAT_RING) c->nlat++;
    if (in_budget) c->streak = 0, c->backoff_ns = BACKOFF_MIN_NS;
}

void daemon_slow(core_t *c, int64_t now) {
    if (++c->streak < BACKOFF_STREAK) return;
    c->streak = 0;
    c->backoff_until = now + c->backoff_ns;
    set_text(c, c->note, "layer %d: the daemon missed its hedge budget %d times in a row; rows are read from the "
             "table files for %.3f s before it is asked again", c->layer, BACKOFF_STREAK, c->backoff_ns / 1e9);
    c->backoff_ns = c->backoff_ns * 2 < BACKOFF_MAX_NS ? c->backoff_ns * 2 : BACKOFF_MAX_NS;
}
