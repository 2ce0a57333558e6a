/* The fetch job's run: see run.h. */
#include "run.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "staging_gate.h"
#include "direct_budget.h"
#include "reader.h"
#include "daemon.h"
#include "writer.h"
#include "board.h"



static void zero_rows(core_t *c, int64_t m) {
    for (int64_t k = 0; k < m; k++) {
        memset(c->weight + c->pos[k] * c->dim, 0, (size_t)c->dim);
        memset(c->scales + c->pos[k] * c->scale_bytes, 0, (size_t)c->scale_bytes);
    }
}

/* Row k of the daemon's packed rows at src goes to staging row pos[k]: its payload into the payload
   block, its scales into the scale block. DeepSeek-V4.1's 256 + 8 bytes get copies of constant size
   (inlined vector moves); other row formats the general loop. */
static void split_rows(core_t *c, const uint8_t *src, int64_t m) {
    const int64_t rb = c->row_bytes, dim = c->dim, sb = c->scale_bytes;
    const int64_t *pos = c->pos;
    if (dim == 256 && sb == 8) {
        for (int64_t k = 0; k < m; k++) {
            const uint8_t *row = src + k * 264;
            memcpy(c->weight + pos[k] * 256, row, 256);
            memcpy(c->scales + pos[k] * 8, row + 256, 8);
        }
        return;
    }
    for (int64_t k = 0; k < m; k++) {
        memcpy(c->weight + pos[k] * dim, src + k * rb, (size_t)dim);
        memcpy(c->scales + pos[k] * sb, src + k * rb + dim, (size_t)sb);
    }
}

static int reader_ok(core_t *c) {
    const reader_t *r = &c->rd;
    return !r->err && !r->nbad && !r->changed[0] && !r->cancelled;
}

/* The reader's result of this step into the staging: 0, or -1 when it failed (recorded, rows zero). */
static int take_direct(core_t *c, int64_t m) {
    reader_t *r = &c->rd;
    const int64_t rpp = c->rows_per_page, rb = c->row_bytes, dim = c->dim, sb = c->scale_bytes;
    atomic_fetch_add(&c->direct_pages, r->pages);
    if (r->changed[0] || r->err || r->cancelled) {
        zero_rows(c, m);
        set_io_error(c);
        if (r->changed[0])
            set_text(c, c->error, "%s; no row is read from a changed file: the %lld rows of this step are zero; "
                     "restart the daemon and the engine on one table set", r->changed, (long long)m);
        else if (r->err)
            set_text(c, c->error, "layer %d: reading page at byte %lld of stripe %lld of its table file failed: %s; "
                     "%lld rows of this step are zero", c->layer, (long long)r->err_off, (long long)r->err_stripe,
                     r->short_read ? "short read (file truncated?)" : strerror(r->err), (long long)m);
        else
            set_text(c, c->error, "layer %d: the job closed during a direct read; %lld rows are zero", c->layer,
                     (long long)m);
        return -1;
    }
    if (r->nbad) {
        char pages[512];
        size_t used = (size_t)snprintf(pages, sizeof pages, "pages");
        for (int64_t b = 0; b < r->nbad && b < SHOWN && used < sizeof pages; b++)
            used += (size_t)snprintf(pages + used, sizeof pages - used, "%s%lld", b ? ", " : " ", (long long)r->bad[b]);
        if (r->nbad > SHOWN && used < sizeof pages)
            snprintf(pages + used, sizeof pages - used, " and %lld more", (long long)(r->nbad - SHOWN));
        char rows[512];
        used = (size_t)snprintf(rows, sizeof rows, "rows");
        int shown = 0;
        for (int64_t k = 0; k < m && shown < SHOWN && used < sizeof rows; k++) {
            for (int64_t b = 0; b < r->nbad; b++) {
                if (r->bad[b] == r->rid[k] / rpp) {
                    used += (size_t)snprintf(rows + used, sizeof rows - used, "%s%lld", shown ? ", " : " ",
                                             (long long)r->rid[k]);
                    shown++;
                    break;
                }
            }
        }
        atomic_fetch_add(&c->bad_pages, r->nbad);
        pthread_mutex_lock(&c->msg_lock);
        if (!c->error[0]) {
            c->error_kind = ERR_CORRUPT;
            c->error_npages = (int)(r->nbad < SHOWN ? r->nbad : SHOWN);
            memcpy(c->error_pages, r->bad, (size_t)c->error_npages * 8);
        }
        pthread_mutex_unlock(&c->msg_lock);
        set_text(c, c->error, "layer %d: %lld page(s) of its table file failed their crc32c check (%s; %s): no good "
                 "copy of those rows exists (the daemon refused them or was not there); their rows are zero in this "
                 "step; repair the table set (engram-store verify names every bad page) and restart the daemon",
                 c->layer, (long long)r->nbad, pages, rows);
    }
    for (int64_t s = 0; s < m; s++) {  /* sorted position s holds row k */
        const int64_t i = c->pos[KEY_K(r->order[s])];
        memcpy(c->weight + i * dim, r->packed + s * rb, (size_t)dim);
        memcpy(c->scales + i * sb, r->packed + s * rb + dim, (size_t)sb);
    }
    return r->nbad ? -1 : 0;
}

/* The step gives up on its one-copy request: no daemon may write it from now on (waiting, to the
   deadline at most, for a write in progress to end or its writer to be gone: writer.h). 0, or -1
   when the daemon still writes (the write's watch kept in c->stuck). */
static int settle_gate(core_t *c, uint64_t rid, int64_t deadline) {
    if (gate_revoke(c->gate) != GATE_WRITING) return 0;
    atomic_fetch_add(&c->gate_waits, 1);
    writer_t w = writer_of(c);
    if (writer_wait(c, &w, deadline)) {
        writer_release(&w);
        return 0;
    }
    c->gate_stuck = rid;
    c->stuck = w;
    return -1;
}

/* Whether the daemon stopped writing the request a step gave up on at its deadline. Waits only for a
   writer whose connection hung up, to the end of its grace (by `limit` at most). */
static int gate_unstuck(core_t *c, int64_t limit) {
    if (!c->gate_stuck) return 1;
    if (!writer_wait(c, &c->stuck, writer_grace_end(&c->stuck, now_ns(), limit))) return 0;
    c->gate_stuck = 0;
    writer_release(&c->stuck);
    return 1;
}

/* The daemon is (still) writing an abandoned request into the staging: this step's rows cannot be trusted. */
static void fail_gate(core_t *c, int64_t m) {
    zero_rows(c, m);
    set_io_error(c);
    set_text(c, c->error, "layer %d: the daemon was still writing request %llu's rows into the staging at a step's "
             "deadline (%.3g s; stopped mid-copy?); until that write ends no step's rows can be trusted: the %lld rows "
             "of this step are zero", c->layer, (unsigned long long)c->gate_stuck, c->deadline_ns / 1e9,
             (long long)m);
    atomic_fetch_add(&c->stuck_steps, 1);
}

/* Nothing complete within the deadline, or no source at all: rows zero, the failure recorded. */
static void fail_step(core_t *c, int64_t m, int asked_daemon, int direct) {
    zero_rows(c, m);
    set_io_error(c);
    const double stuck = reader_stuck_seconds(c);
    char why[256];
    if (direct == D_UNAVAILABLE && stuck > 0)
        snprintf(why, sizeof why, "direct reads are stuck (a read of its table files has not completed for %.1f s)%s",
                 stuck, asked_daemon ? " and the daemon did not answer" : " and the daemon is not connected");
    else if (direct == D_UNAVAILABLE)
        snprintf(why, sizeof why, "no reader thread could be started%s",
                 asked_daemon ? " and the daemon did not answer" : " and the daemon is not connected");
    else if (direct == D_NONE)
        snprintf(why, sizeof why, "the daemon did not answer");
    else if (direct == D_REFUSED)
        snprintf(why, sizeof why, "%sno direct read could start: the node's budget of direct pages in flight "
                 "(ENGRAM_STORE_DIRECT_BUDGET_PAGES) was taken by other jobs' reads throughout",
                 asked_daemon ? "the daemon did not answer and " : "the daemon is not connected and ");
    else
        snprintf(why, sizeof why, "%sthe direct read of its table files did not complete (a stuck device?)",
                 asked_daemon ? "the daemon did not answer and " : "");
    const int at_once = direct == D_UNAVAILABLE && !asked_daemon;  /* nothing to wait for: failed at once */
    char when[64];
    if (at_once) snprintf(when, sizeof when, "no rows for this step");
    else snprintf(when, sizeof when, "no rows within the fetch deadline (%.3g s)", c->deadline_ns / 1e9);
    set_text(c, c->error, "layer %d: %s: %s; the %lld rows of this step are zero", c->layer, when, why, (long long)m);
    atomic_fetch_add(at_once ? &c->stuck_steps : &c->timeouts, 1);
}

/* One step's taken rows (m of its n): the daemon, hedged by a direct read, within the deadline. 0, or -1
   failed. */
static int fetch_step(core_t *c, int64_t m, int64_t n, int64_t t0) {
    const int64_t deadline = t0 + c->deadline_ns;
    int daemon = 0, asked = 0, direct = D_NONE, hedged = 0, from_daemon = 0, from_files = 0, opened = 0;
    int refused = 0, direct_asked = 0;  /* the node's budget refused a direct read; the daemon was asked first */
    uint64_t gen = 0;
    int64_t sent = 0, hedge_at = 0, retry_at = 0;
    int usable = daemon_usable(c, t0, budget_room(c));
    if (usable) {
        const int split = c->split;
        const uint64_t before = c->request_id;
        usable = send_request(c, m, n) == 0;
        opened = split && c->request_id != before;  /* the gate was opened (even when the send failed) */
    }
    if (usable) {
        daemon = asked = 1;
        sent = now_ns();
        const int64_t budget = hedge_budget(c);
        atomic_store(&c->hedge_ns, budget);
        hedge_at = sent + budget;
    } else {
        direct = D_WANT;
    }
    for (;;) {
        if (direct == D_WANT && now_ns() >= retry_at) {
            const int s = reader_submit(c, m, &gen);
            if (s == -2) {  /* the node's budget is spent: wait (for the daemon, or the budget) instead */
                if (!refused) atomic_fetch_add(&c->budget_refusals, 1);
                refused = 1;
                retry_at = now_ns() + BUDGET_RETRY_NS;
            } else {
                direct = s > 0 ? D_RUNNING : s < 0 ? D_UNAVAILABLE : D_WANT;
                if (s > 0) direct_asked = asked;
            }
        }
        if (direct == D_HELD && !daemon) {
            from_files = 1;
            break;
        }
        if (!daemon && direct != D_WANT && direct != D_RUNNING) break;
        const int64_t now = now_ns();
        if (now >= deadline) break;
        int64_t until = daemon && direct == D_NONE && hedge_at < deadline ? hedge_at : deadline;
        if (direct == D_WANT && retry_at > now && retry_at < until) until = retry_at;
        struct pollfd p[2];
        int np = 0, ps = -1, pe = -1;
        if (daemon) p[ps = np++] = (struct pollfd){.fd = c->sock, .events = POLLIN};
        if (direct == D_WANT || direct == D_RUNNING) p[pe = np++] = (struct pollfd){.fd = c->rd.efd, .events = POLLIN};
        const int64_t wait = until > now ? until - now : 0;
        const struct timespec ts = {.tv_sec = wait / 1000000000, .tv_nsec = wait % 1000000000};
        const int rc = ppoll(p, (nfds_t)np, &ts, NULL);
        if (rc < 0 && errno != EINTR) break;
        if (rc <= 0) {
            if (daemon && direct == D_NONE && now_ns() >= hedge_at) {  /* the budget is spent: read directly too */
                direct = D_WANT;
                hedged = 1;
                atomic_fetch_add(&c->hedged_steps, 1);
            }
            continue;
        }
        if (ps >= 0 && p[ps].revents) {
            const int a = read_answer(c, deadline);
            daemon = 0;
            if (a > 0 && opened && !gate_is_done(c->gate, c->request_id)) {
                atomic_fetch_add(&c->daemon_errors, 1);
                set_text(c, c->note, "layer %d: the daemon answered request %llu without writing it into the staging; "
                         "its rows are read from the table files", c->layer, (unsigned long long)c->request_id);
            } else if (a > 0) {
                from_daemon = 1;
                break;
            }
            if (direct == D_NONE) direct = D_WANT;  /* an error answer or a failed transport: the files */
            continue;
        }
        if (pe >= 0 && p[pe].revents && reader_poll(c, gen) && direct == D_RUNNING) {
            if (!daemon || reader_ok(c)) {
                from_files = 1;
                break;
            }
            direct = D_HELD;  /* a failed direct read waits for the daemon's answer */
        }
    }
    const int64_t end = now_ns();
    if (!from_daemon && !from_files && direct == D_HELD) from_files = 1;  /* the failed read stands */
    if (from_daemon) {
        if (direct == D_RUNNING) reader_abandon(c, 0);
        if (opened) {  /* the daemon wrote them into the staging: one host copy */
            atomic_fetch_add(&c->one_copy_steps, 1);
        } else {
            split_rows(c, c->region + c->out_off, m);
            atomic_fetch_add(&c->copied_rows, m);
        }
        daemon_answered(c, end - sent, !hedged);
        if (hedged) daemon_slow(c, end);
        atomic_fetch_add(&c->daemon_steps, 1);
        if (refused) atomic_fetch_add(&c->waited_steps, 1);  /* served by waiting instead of reading directly */
        return 0;
    }
    /* before any row of the step's own goes in (and while the connection is there to watch the writer) */
    const int stuck = opened && settle_gate(c, c->request_id, deadline) < 0;
    if (daemon) {  /* still unanswered: its answer is read and dropped before the next request */
        c->pending_id = c->request_id;
        c->pending_since = sent;
        if (!from_files) daemon_drop(c, "no answer within the deadline");
        else daemon_slow(c, end);
    }
    if (stuck) {
        if (direct == D_RUNNING || direct == D_WANT) reader_abandon(c, 0);
        fail_gate(c, m);
        return -1;
    }
    if (from_files) {
        atomic_fetch_add(&c->direct_steps, 1);
        atomic_fetch_add(direct_asked ? &c->hedged_direct_steps : &c->fallback_direct_steps, 1);
        return take_direct(c, m);
    }
    if (direct == D_RUNNING || direct == D_WANT) reader_abandon(c, 1);
    fail_step(c, m, asked, direct == D_WANT && refused ? D_REFUSED : direct);
    return -1;
}

static void job_run(core_t *c, int64_t n) {
    const int64_t t0 = now_ns();
    pthread_mutex_lock(&c->lock);
    if (c->closed) {  /* a host function queued (or a graph replayed) after the job was closed */
        pthread_mutex_unlock(&c->lock);
        atomic_fetch_add(&late_calls, 1);
        return;
    }
    if (n > c->max_rows) n = c->max_rows;
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = c->ids[i];
        if (id >= 0 && id < c->layer_rows) {
            c->pos[m++] = i;
        } else {  /* padding: zeros, as the engines' kernels read for ids they do not own */
            memset(c->weight + i * c->dim, 0, (size_t)c->dim);
            memset(c->scales + i * c->scale_bytes, 0, (size_t)c->scale_bytes);
        }
    }
    if (c->gate_stuck && !gate_unstuck(c, t0 + c->deadline_ns)) {  /* a daemon may still write into the staging */
        fail_gate(c, m);
        atomic_fetch_add(&c->failed_steps, 1);
        board_publish(c);
    } else if (m && fetch_step(c, m, n, t0) < 0) {
        atomic_fetch_add(&c->failed_steps, 1);
        board_publish(c);  /* before the step's rows are used: every rank's check sees it */
    }
    const int64_t dt = now_ns() - t0;
    atomic_fetch_add(&c->steps, 1);
    atomic_fetch_add(&c->rows, m);
    atomic_store(&c->last_ns, dt);
    atomic_fetch_add(&c->total_ns, dt);
    for (int64_t mx = atomic_load(&c->max_ns); dt > mx && !atomic_compare_exchange_weak(&c->max_ns, &mx, dt);) {
    }
    pthread_mutex_unlock(&c->lock);
}

void engram_fetch_host_fn(void *call) {
    fetch_call *c = call;
    job_run(c->core, c->rows);
}

void *run_in_thread(void *call) {
    engram_fetch_host_fn(call);
    return NULL;
}
