/* crc32c (Castagnoli) for the native readers' page checks: the one implementation, a unit
 * (crc32c.c) linked into each extension that checks pages (_pread, _uring, _fetch).
 *
 * crc_init() once, at module init: builds the tables and probes the CPU's crc32c instruction.
 * crc32c_implementation()              "sse4.2", "armv8-crc32" or "software": what page checks use here
 * crc32c_hw_available()                1 when the crc32c instruction is used (after crc_init)
 * crc32c_any(crc, p, n, hw)            crc32c of n bytes, chained like zlib.crc32
 * crc32c_pages_any(p, npages, out, hw) out[i] = crc32c of 4 KiB page i
 * crc32c_check_pages(p, first, npages, expected, bad, &nbad)
 *     checks npages pages that are pages first.. of a file against expected[first..]:
 *     appends the page number of each failure to bad and returns a mask of them
 *     (bit k: page k of p), so a caller copies rows only out of pages that passed.
 * hw: may use the crc32c instruction (0: the tables, for tests).
 */
#ifndef ENGRAM_STORE_CRC32C_H
#define ENGRAM_STORE_CRC32C_H

#include <stddef.h>
#include <stdint.h>

#define PAGE 4096
#define MAX_CHECKED_PAGES 64     /* pages of one checked extent: a bit each in a uint64_t mask */

void crc_init(void);
const char *crc32c_implementation(void);
int crc32c_hw_available(void);
uint32_t crc32c_any(uint32_t crc, const uint8_t *p, size_t n, int hw);
void crc32c_pages_any(const uint8_t *p, int64_t npages, uint32_t *out, int hw);
uint64_t crc32c_check_pages(const uint8_t *p, int64_t first, int64_t npages, const uint32_t *expected, int64_t *bad,
                            int64_t *nbad);

#endif
