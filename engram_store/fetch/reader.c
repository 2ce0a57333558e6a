/* The fetch job's reader: see reader.h. */
#include "reader.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include "crc32c.h"
#include "batch.h"
#include "aio.h"
#include "test_hooks.h"
#include "direct_budget.h"



void crc_blob_release(crc_blob *b) {
    if (b && atomic_fetch_sub(&b->refs, 1) == 1) free(b);
}

static int64_t ts_ns(struct timespec t) { return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec; }

/* 0: every watched file is the one opened; 1: one changed (why in msg). */
static int files_changed(core_t *c, char *msg) {
    reader_t *r = &c->rd;
    for (int i = 0; i < r->nwatch; i++) {
        const watched_t *w = &r->watch[i];
        struct stat st, now;
        const char *what = NULL;
        char detail[160] = "";
        if (fstat(w->fd, &st) != 0) {
            what = "cannot be checked";
            snprintf(detail, sizeof detail, "fstat: %s", strerror(errno));
        } else if ((int64_t)st.st_size != w->size) {
            what = "changed size";
            snprintf(detail, sizeof detail, "%lld -> %lld bytes", (long long)w->size, (long long)st.st_size);
        } else if (stat(w->path, &now) != 0) {
            what = "is gone";
            snprintf(detail, sizeof detail, "stat: %s", strerror(errno));
        } else if ((int64_t)now.st_dev != w->dev || (int64_t)now.st_ino != w->ino) {
            what = "was replaced";
            snprintf(detail, sizeof detail, "device %lld inode %lld, opened as device %lld inode %lld",
                     (long long)now.st_dev, (long long)now.st_ino, (long long)w->dev, (long long)w->ino);
        } else if (ts_ns(st.st_mtim) != w->mtime_ns || ts_ns(st.st_ctim) != w->ctime_ns) {
            what = "was written";
            snprintf(detail, sizeof detail, "its modification or status change time moved");
        }
        if (what) {
            snprintf(msg, MSG_BYTES, "layer %d: its %s %s %s since the engine opened it (%s)", c->layer,
                     i == r->nwatch - 1 ? "checksum file" : "table file", w->path, what, detail);
            return 1;
        }
    }
    return 0;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* One request: the rows' pages, one batch per stripe, each page checked; rows packed in sorted order
   (rows of a page that failed stay zero). Runs on the reader thread, touching only the reader's own. */
static void read_request(core_t *c) {
    reader_t *r = &c->rd;
    const int64_t K = r->nstripes, rpp = c->rows_per_page, rb = c->row_bytes, m = r->m;
    r->nbad = r->pages = r->err_off = r->err_stripe = 0;
    r->err = r->short_read = r->cancelled = 0;
    r->changed[0] = 0;
    if (files_changed(c, r->changed)) return;
    for (int64_t k = 0; k < m; k++) {
        const int64_t page = r->rid[k] / rpp;
        r->order[k] = ((uint64_t)(page % K) << (KEY_PAGE_BITS + KEY_ROW_BITS)) |
                      ((uint64_t)(page / K) << KEY_ROW_BITS) | (uint64_t)k;
    }
    qsort(r->order, (size_t)m, sizeof(uint64_t), cmp_u64);
    memset(r->packed, 0, (size_t)(m * rb));
    int64_t q = 0;
    while (q < m && !r->err && !r->cancelled) {  /* one batch per stripe */
        const int64_t stripe = KEY_STRIPE(r->order[q]), start = q;
        int64_t n_ext = 0, last = -1;
        for (; q < m && KEY_STRIPE(r->order[q]) == stripe; q++) {
            const int64_t local = (int64_t)((r->order[q] >> KEY_ROW_BITS) & (((uint64_t)1 << KEY_PAGE_BITS) - 1));
            if (local != last) {
                r->ext_off[n_ext] = local * PAGE;
                r->ext_len[n_ext] = PAGE;
                r->first_row[n_ext] = q - start;
                n_ext++;
                last = local;
            }
            r->row_off[q - start] = (r->rid[KEY_K(r->order[q])] % rpp) * rb;
        }
        r->first_row[n_ext] = q - start;
        batch_t b = {.fd = r->watch[stripe].fd, .cancel = &r->cancel};
        b.a.n = b.a.n_len = b.a.n_dst = n_ext;
        b.a.off = r->ext_off;
        b.a.len = r->ext_len;
        b.a.out = (char *)(r->packed + start * rb);
        b.a.row_bytes = rb;
        b.a.first_row = r->first_row;
        b.a.n_first = n_ext + 1;
        b.a.row_off = r->row_off;
        b.a.rows = b.a.out_len = q - start;
        b.a.scratch = (char *)r->scratch;
        b.a.slot = PAGE;
        b.a.crcs = r->crcs->crc;
        b.a.ncrcs = r->crcs->n;
        b.a.crc_stride = K;
        b.a.crc_phase = stripe;
        b.a.bad = r->bad + r->nbad;
        int64_t got = read_aio(&b, r->qd_now);
        if (got < 0) got = read_sync(&b);
        r->pages += n_ext;
        r->nbad += b.a.nbad;
        r->cancelled = b.cancelled;
        if (b.err) {
            r->err = b.err, r->err_off = b.err_off, r->err_stripe = stripe, r->short_read = b.short_read;
            memset(r->packed, 0, (size_t)(m * rb));
        }
    }
    if (!r->err && !r->cancelled && files_changed(c, r->changed))  /* changed while it read: nothing is trusted */
        memset(r->packed, 0, (size_t)(m * rb));
}

static void *reader_main(void *arg) {
    core_t *c = arg;
    reader_t *r = &c->rd;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (r->state != R_BUSY && !r->quit) pthread_cond_wait(&r->cv, &r->mu);
        if (r->state != R_BUSY) break;  /* closed while idle */
        pthread_mutex_unlock(&r->mu);
        test_hook_hold(TEST_HOOK_HOLD_READS);
        read_request(c);
        budget_give(c, r->held, r->nheld);  /* its pages are no longer in flight */
        r->nheld = 0;
        pthread_mutex_lock(&r->mu);
        r->state = R_DONE;
        r->stuck = 0;
        const uint64_t one = 1;
        if (write(r->efd, &one, sizeof one) < 0) { /* an eventfd write fails only on overflow */ }
        pthread_cond_broadcast(&r->cv);
    }
    r->started = 0;
    pthread_mutex_unlock(&r->mu);
    r->release(c);
    return NULL;
}

/* Under r->mu. 0, or -1 when no thread could be made. */
static int reader_start(core_t *c) {
    reader_t *r = &c->rd;
    if (r->started && r->pid == getpid()) return 0;
    r->state = R_IDLE;  /* a forked child: the parent's thread and its request are not here */
    r->stuck = 0;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    atomic_fetch_add(&c->refs, 1);
    const int rc = pthread_create(&t, &attr, reader_main, c);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        atomic_fetch_sub(&c->refs, 1);
        return -1;
    }
    r->started = 1;
    r->pid = getpid();
    return 0;
}

int reader_submit(core_t *c, int64_t m, uint64_t *gen) {
    reader_t *r = &c->rd;
    pthread_mutex_lock(&r->mu);
    if (reader_start(c) < 0) {
        pthread_mutex_unlock(&r->mu);
        return -1;
    }
    if (r->state == R_DONE) r->state = R_IDLE;  /* a result nobody waits for any more */
    if (r->state == R_BUSY) {
        const int stuck = r->stuck;
        pthread_mutex_unlock(&r->mu);
        return stuck ? -1 : 0;
    }
    r->qd_now = r->qd;
    if (c->budget) {  /* a share of the node's budget: at most this read's pages, at most qd */
        r->qd_now = (int)budget_take(c, m < r->qd ? m : r->qd, r->held, &r->nheld);
        if (!r->qd_now) {
            pthread_mutex_unlock(&r->mu);
            return -2;
        }
    }
    uint64_t count;
    while (read(r->efd, &count, sizeof count) > 0) {  /* ends already seen */
    }
    for (int64_t k = 0; k < m; k++) r->rid[k] = c->ids[c->pos[k]];
    r->m = m;
    __atomic_store_n(&r->cancel, 0, __ATOMIC_RELAXED);
    *gen = ++r->gen;
    r->since = now_ns();
    r->state = R_BUSY;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return 1;
}

int reader_poll(core_t *c, uint64_t gen) {
    reader_t *r = &c->rd;
    uint64_t count;
    while (read(r->efd, &count, sizeof count) > 0) {
    }
    pthread_mutex_lock(&r->mu);
    const int mine = r->state == R_DONE && r->gen == gen;
    pthread_mutex_unlock(&r->mu);
    return mine;
}

void reader_abandon(core_t *c, int stuck) {
    reader_t *r = &c->rd;
    pthread_mutex_lock(&r->mu);
    if (r->state == R_BUSY) {
        __atomic_store_n(&r->cancel, 1, __ATOMIC_RELAXED);
        if (stuck) r->stuck = 1;
    }
    pthread_mutex_unlock(&r->mu);
}

int reader_idle(core_t *c) {
    reader_t *r = &c->rd;
    pthread_mutex_lock(&r->mu);
    const int idle = r->state != R_BUSY;
    pthread_mutex_unlock(&r->mu);
    return idle;
}

double reader_stuck_seconds(core_t *c) {
    reader_t *r = &c->rd;
    pthread_mutex_lock(&r->mu);
    const double s = r->state == R_BUSY && r->stuck ? (now_ns() - r->since) / 1e9 : 0;
    pthread_mutex_unlock(&r->mu);
    return s;
}

void reader_quit(core_t *c) {
    reader_t *r = &c->rd;
    pthread_mutex_lock(&r->mu);
    r->quit = 1;
    __atomic_store_n(&r->cancel, 1, __ATOMIC_RELAXED);
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

int reader_init(core_t *c, int qd, void (*release)(core_t *c)) {
    reader_t *r = &c->rd;
    const int64_t n = c->max_rows;
    r->release = release;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->qd = qd;
    r->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (posix_memalign((void **)&r->scratch, PAGE, (size_t)qd * PAGE) != 0) r->scratch = NULL;
    r->rid = malloc((size_t)n * 8);
    r->order = malloc((size_t)n * 8);
    r->ext_off = malloc((size_t)n * 8);
    r->ext_len = malloc((size_t)n * 8);
    r->first_row = malloc((size_t)(n + 1) * 8);
    r->row_off = malloc((size_t)n * 8);
    r->bad = malloc((size_t)n * 8);
    r->packed = malloc((size_t)(n * c->row_bytes));
    return r->efd < 0 || !r->scratch || !r->rid || !r->order || !r->ext_off || !r->ext_len || !r->first_row ||
                   !r->row_off || !r->bad || !r->packed ? -1 : 0;
}

void reader_free(core_t *c) {
    reader_t *r = &c->rd;
    for (int i = 0; i < r->nwatch; i++) {
        if (r->watch[i].fd >= 0) close(r->watch[i].fd);
        free(r->watch[i].path);
    }
    r->nwatch = r->nstripes = 0;
    if (r->efd >= 0) close(r->efd);
    r->efd = -1;
    free(r->scratch); free(r->rid); free(r->order); free(r->ext_off); free(r->ext_len); free(r->first_row);
    free(r->row_off); free(r->bad); free(r->packed);
    r->scratch = r->packed = NULL;
    r->rid = r->ext_off = r->ext_len = r->first_row = r->row_off = r->bad = NULL;
    r->order = NULL;
    crc_blob_release(r->crcs);
    r->crcs = NULL;
}
