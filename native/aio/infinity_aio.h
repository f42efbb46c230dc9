/* infinity_aio: asynchronous file I/O over io_uring, with a thread-pool fallback.
 *
 * A small C ABI on raw pointers, lengths and byte offsets. Every function that can fail
 * returns a negative errno; nothing here knows about tensors or Python.
 *
 * Each request names two descriptors of the same file: `fd_direct` (opened with O_DIRECT,
 * or -1 when the file system refuses it) and `fd_buffered` (an ordinary descriptor). The
 * library moves whole 4 KiB-aligned blocks through `fd_direct`, straight between the file
 * and the caller's memory, and only the partial blocks at either end of a request through
 * `fd_buffered`. Caller memory that is not 4 KiB-aligned relative to the file offset is
 * staged through aligned bounce buffers. The caller keeps `buf` valid until the request
 * has completed (infinity_aio_wait returned with it counted).
 *
 * No C++ exception crosses this ABI: running out of memory or threads is -ENOMEM / -EAGAIN.
 */
#ifndef INFINITY_AIO_H
#define INFINITY_AIO_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct infinity_aio infinity_aio;

/* Checksums of a file's 4 KiB blocks, kept in host memory (Note [block sums] in sums.h).
 * A request given a table records the CRC32C of every block it writes, computed from the
 * caller's memory just before the write is issued, and checks every block it reads whose sum
 * is known once the data has landed. A mismatch fails the request with EBADMSG; the error's
 * offset and length are those of the first bad block. Safe to share between handles. */
typedef struct infinity_aio_sums infinity_aio_sums;

#define INFINITY_AIO_AUTO 0
#define INFINITY_AIO_URING 1
#define INFINITY_AIO_THREADS 2

#define INFINITY_AIO_READ 0
#define INFINITY_AIO_WRITE 1

/* One failed request: the piece that failed, how far it got, and why. */
typedef struct infinity_aio_error {
    int64_t id;          /* request id returned by infinity_aio_submit */
    int64_t offset;      /* file offset of the failed piece */
    int64_t length;      /* length of the failed piece */
    int64_t transferred; /* bytes of that piece that did move before the failure */
    int32_t err;         /* positive errno; ENODATA: end of file reached on a read */
    int32_t op;          /* INFINITY_AIO_READ or INFINITY_AIO_WRITE */
} infinity_aio_error;

/* A table for a file of up to `capacity_bytes` (blocks past it are neither recorded nor
 * checked); -ENOMEM or -EINVAL. */
int infinity_aio_sums_create(int64_t capacity_bytes, infinity_aio_sums **out);
void infinity_aio_sums_destroy(infinity_aio_sums *s);
/* Host memory the table holds now. */
int64_t infinity_aio_sums_bytes(const infinity_aio_sums *s);
/* Blocks found bad so far; blocks written whose sum could not be stored (no memory). */
int64_t infinity_aio_sums_mismatches(const infinity_aio_sums *s);
int64_t infinity_aio_sums_unrecorded(const infinity_aio_sums *s);
/* The entries of blocks [first, first + count) into out[0..count) (Note [block sums] in sums.h: the
 * CRC32C in the low half, the length of the block prefix it covers above; 0: nothing known),
 * and setting them, e.g. when a clone made the file hold what another table vouches for.
 * -EINVAL for a bad range; set: -ENOMEM when an entry could not be stored. */
int infinity_aio_sums_get(const infinity_aio_sums *s, int64_t first, int64_t count, uint64_t *out);
int infinity_aio_sums_set(infinity_aio_sums *s, int64_t first, int64_t count, const uint64_t *in);
/* CRC32C of `n` bytes continuing `crc` (0 to start). `impl`: 0 the fastest this CPU has,
 * 1 the portable scalar code (a reference for tests). */
uint32_t infinity_aio_crc32c(uint32_t crc, const void *buf, int64_t n, int32_t impl);
/* CRC32C of each of `count` whole 4 KiB blocks at `buf` into out[0..count), the way writes
 * and reads sum them (three blocks interleaved on the SSE4.2 path). */
void infinity_aio_crc32c_blocks(const void *buf, int64_t count, uint32_t *out);
/* 1 if CRC32C uses the CPU's SSE4.2 instruction (chosen at run time by CPUID). */
int infinity_aio_crc32c_hardware(void);

/* Test-only fault injection at the I/O layer, inert unless armed. Pieces (the block_size
 * requests a transfer is cut into) of `op` on the file with device `dev` and inode `ino` are
 * counted from the call; the `nth` (1-based) and the `count` - 1 after it (count <= 0: every
 * one from the nth on) get `fault`:
 *   ERRNO: the transfer fails with errno `arg` (EIO, ENOSPC, ...);
 *   SHORT: it moves `arg` bytes at most, and its retry finds the end of the file;
 *   STALL: it starts after `arg` milliseconds;
 *   FLIP:  byte `arg` of the piece has its lowest bit flipped (in memory after a read, in the
 *          file after a write);
 *   ZERO:  the piece's bytes read as zeros (after a read: in memory; after a write: in the file).
 * Returns a rule id >= 0 or -errno; infinity_aio_inject_clear removes every rule, and
 * infinity_aio_inject_hits says how many pieces a rule has hit. */
#define INFINITY_AIO_FAULT_ERRNO 1
#define INFINITY_AIO_FAULT_SHORT 2
#define INFINITY_AIO_FAULT_STALL 3
#define INFINITY_AIO_FAULT_FLIP 4
#define INFINITY_AIO_FAULT_ZERO 5
int infinity_aio_inject(uint64_t dev, uint64_t ino, int32_t op, int64_t nth, int64_t count, int32_t fault,
                        int64_t arg);
int64_t infinity_aio_inject_hits(int32_t rule);
void infinity_aio_inject_clear(void);

/* 1 if this build has io_uring support compiled in. */
int infinity_aio_has_uring(void);

/* Creates a handle. `backend` is INFINITY_AIO_AUTO, _URING or _THREADS. With AUTO, a
 * failure to set up io_uring falls back to threads and `why` (if not NULL) says why; with
 * _URING such a failure is returned as -errno with `why` filled in. */
int infinity_aio_create(int32_t backend, int64_t block_size, int32_t queue_depth, int32_t threads,
                        infinity_aio **out, char *why, size_t why_len);

/* INFINITY_AIO_URING or INFINITY_AIO_THREADS. */
int infinity_aio_backend(const infinity_aio *h);

/* Finishes everything in flight, then frees the handle. Errors not yet collected are lost. */
void infinity_aio_destroy(infinity_aio *h);

/* Queues a read or write and returns its id (>= 0) at once, or -errno for bad arguments. */
int64_t infinity_aio_submit(infinity_aio *h, int32_t op, int32_t fd_direct, int32_t fd_buffered,
                            void *buf, int64_t length, int64_t offset, infinity_aio_sums *sums);

/* Reads or writes synchronously through the handle's workers; 0 or -errno with *err filled.
 * Independent of infinity_aio_wait: its completion is never counted there. */
int infinity_aio_rw(infinity_aio *h, int32_t op, int32_t fd_direct, int32_t fd_buffered, void *buf,
                    int64_t length, int64_t offset, infinity_aio_sums *sums, infinity_aio_error *err);

/* Blocks until every request submitted before the call has completed. Returns how many
 * requests completed since the previous wait. Up to `max_errs` failures are copied to
 * `errs`, their total count to *n_errs; the handle forgets them. *horizon receives the
 * first request id not covered by this wait. */
int64_t infinity_aio_wait(infinity_aio *h, infinity_aio_error *errs, int32_t max_errs,
                          int32_t *n_errs, int64_t *horizon);

/* Blocks until every request submitted before the call has completed (1) or `timeout_ms`
 * milliseconds passed (0); a negative timeout waits without limit, 0 only looks. Consumes
 * nothing: completions, errors and the horizon are still collected by infinity_aio_wait,
 * which returns at once afterwards when this returned 1. Safe beside other waiters. */
int infinity_aio_wait_for(infinity_aio *h, int64_t timeout_ms);

/* 0, or -errno of a failure to enter io_uring that has persisted (the ring thread retries with
 * a growing pause meanwhile, never spinning); the requests it holds stay in flight. */
int infinity_aio_ring_error(infinity_aio *h);

/* Requests submitted and not yet completed. */
int64_t infinity_aio_in_flight(infinity_aio *h);

/* Ids of the requests submitted and not yet completed, smallest first: up to `max_ids`
 * are copied to `ids`; returns how many there are in all. */
int64_t infinity_aio_in_flight_ids(infinity_aio *h, int64_t *ids, int64_t max_ids);

/* How many pieces were retried through fd_buffered after fd_direct refused them (EINVAL). */
int64_t infinity_aio_direct_fallbacks(infinity_aio *h);

/* Anonymous memory aligned to 2 MiB and advised for transparent huge pages (`hugepage`
 * != 0), or to 4 KiB. *huge is set to 1 when the advice was accepted. NULL on failure. */
void *infinity_aio_alloc(int64_t bytes, int32_t hugepage, int32_t *huge);
void infinity_aio_free(void *p, int64_t bytes, int32_t hugepage);

/* Gives the pages of [p, p + bytes) back to the kernel (MADV_DONTNEED), keeping the mapping:
 * the range reads as zeros afterwards and is faulted in again (as huge pages where advised)
 * when next touched. Only whole pages of `align` bytes (4096 or 2 MiB) inside the range
 * are released. Returns the bytes released, or -errno. */
int64_t infinity_aio_release(void *p, int64_t bytes, int64_t align);

/* Bytes of [p, p + bytes) resident in memory now (mincore over its 4 KiB pages; `p` page
 * aligned), or -errno. */
int64_t infinity_aio_resident(void *p, int64_t bytes);

#ifdef __cplusplus
}
#endif

#endif /* INFINITY_AIO_H */
