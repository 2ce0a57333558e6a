/* The fetch job's core: see core.h. */
#include "core.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

_Atomic int64_t live_cores, late_calls;

int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

void set_text(core_t *c, char *dst, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&c->msg_lock);
    if (dst != c->error || !dst[0]) vsnprintf(dst, MSG_BYTES, fmt, ap);  /* the first error stands until reported */
    pthread_mutex_unlock(&c->msg_lock);
    va_end(ap);
}

void set_io_error(core_t *c) {
    pthread_mutex_lock(&c->msg_lock);
    if (!c->error[0]) c->error_kind = ERR_IO, c->error_npages = 0;
    pthread_mutex_unlock(&c->msg_lock);
}
