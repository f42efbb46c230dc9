// infinity_aio: the C ABI of handles and block-sum tables declared in infinity_aio.h,
// over the engine (engine.h) and the sums (sums.h); see engine.h for the other sources.

#include "engine.h"

#include <errno.h>
#include <stddef.h>

#include <memory>

using namespace infinity_aio_impl;

namespace {

bool valid_rw(int op, int fd_direct, int fd_buffered, const void *buf, int64_t len, int64_t off) {
    if (op != INFINITY_AIO_READ && op != INFINITY_AIO_WRITE) return false;
    if (fd_buffered < 0 || fd_direct < -1 || len < 0 || off < 0) return false;
    return buf != nullptr || len == 0;
}

}  // namespace

struct infinity_aio {
    infinity_aio(int backend, int64_t bs, int qd, int threads) : engine(backend, bs, qd, threads) {}
    Engine engine;
};

struct infinity_aio_sums {
    explicit infinity_aio_sums(int64_t capacity) : table(capacity) {}
    infinity_sums::Table table;
};

extern "C" {

int infinity_aio_has_uring(void) {
#ifdef INFINITY_AIO_NO_URING
    return 0;
#else
    return 1;
#endif
}

int infinity_aio_create(int32_t backend, int64_t block_size, int32_t queue_depth, int32_t threads,
                        infinity_aio **out, char *why, size_t why_len) {
    if (why && why_len) why[0] = '\0';
    if (!out || block_size < kAlign || block_size % kAlign != 0 || block_size > (1LL << 30) ||
        queue_depth < 1 || queue_depth > 32768 || threads < 1 || threads > 256 || backend < 0 ||
        backend > INFINITY_AIO_THREADS)
        return -EINVAL;
    return guarded([&]() -> int {
        std::unique_ptr<infinity_aio> h(new infinity_aio(backend, block_size, queue_depth, threads));
        int rc = h->engine.start(why, why_len);  // a throw here joins the threads already started
        if (rc < 0) return rc;
        *out = h.release();
        return 0;
    });
}

int infinity_aio_backend(const infinity_aio *h) { return h->engine.backend(); }

void infinity_aio_destroy(infinity_aio *h) { delete h; }

int64_t infinity_aio_submit(infinity_aio *h, int32_t op, int32_t fd_direct, int32_t fd_buffered,
                            void *buf, int64_t length, int64_t offset, infinity_aio_sums *sums) {
    if (!valid_rw(op, fd_direct, fd_buffered, buf, length, offset)) return -EINVAL;
    return guarded([&]() -> int64_t {
        return h->engine.submit(op, fd_direct, fd_buffered, static_cast<char *>(buf), length, offset,
                                sums ? &sums->table : nullptr);
    });
}

int infinity_aio_rw(infinity_aio *h, int32_t op, int32_t fd_direct, int32_t fd_buffered, void *buf,
                    int64_t length, int64_t offset, infinity_aio_sums *sums, infinity_aio_error *err) {
    if (!valid_rw(op, fd_direct, fd_buffered, buf, length, offset)) return -EINVAL;
    return guarded([&]() -> int {
        return h->engine.rw(op, fd_direct, fd_buffered, static_cast<char *>(buf), length, offset,
                            sums ? &sums->table : nullptr, err);
    });
}

int64_t infinity_aio_wait(infinity_aio *h, infinity_aio_error *errs, int32_t max_errs,
                          int32_t *n_errs, int64_t *horizon) {
    return h->engine.wait(errs, max_errs, n_errs, horizon);  // allocates nothing
}

int infinity_aio_wait_for(infinity_aio *h, int64_t timeout_ms) {
    return guarded([&]() -> int { return h->engine.wait_for(timeout_ms) ? 1 : 0; });
}

int infinity_aio_ring_error(infinity_aio *h) { return h->engine.ring_error(); }

int64_t infinity_aio_in_flight(infinity_aio *h) { return h->engine.in_flight(); }

int64_t infinity_aio_in_flight_ids(infinity_aio *h, int64_t *ids, int64_t max_ids) {
    if (!ids) max_ids = 0;
    return h->engine.in_flight_ids(ids, max_ids);
}

int64_t infinity_aio_direct_fallbacks(infinity_aio *h) { return h->engine.direct_fallbacks(); }

int infinity_aio_sums_create(int64_t capacity_bytes, infinity_aio_sums **out) {
    if (!out || capacity_bytes < 0) return -EINVAL;
    return guarded([&]() -> int {
        *out = new infinity_aio_sums(capacity_bytes);
        return 0;
    });
}

void infinity_aio_sums_destroy(infinity_aio_sums *s) { delete s; }

int64_t infinity_aio_sums_bytes(const infinity_aio_sums *s) {
    return s->table.leaf_bytes() + (s->table.capacity_bytes() / infinity_sums::Table::kLeafBlocks / kAlign) *
                                       static_cast<int64_t>(sizeof(void *));
}

int64_t infinity_aio_sums_mismatches(const infinity_aio_sums *s) { return s->table.mismatches.load(); }

int64_t infinity_aio_sums_unrecorded(const infinity_aio_sums *s) { return s->table.unrecorded.load(); }

int infinity_aio_sums_get(const infinity_aio_sums *s, int64_t first, int64_t count, uint64_t *out) {
    if (!s || first < 0 || count < 0 || (count > 0 && !out)) return -EINVAL;
    for (int64_t i = 0; i < count; ++i) out[i] = s->table.get(first + i);
    return 0;
}

int infinity_aio_sums_set(infinity_aio_sums *s, int64_t first, int64_t count, const uint64_t *in) {
    if (!s || first < 0 || count < 0 || (count > 0 && !in)) return -EINVAL;
    int rc = 0;
    for (int64_t i = 0; i < count; ++i)
        if (!s->table.set(first + i, in[i])) rc = -ENOMEM;
    return rc;
}

uint32_t infinity_aio_crc32c(uint32_t crc, const void *buf, int64_t n, int32_t impl) {
    if (!buf || n <= 0) return crc;
    const size_t len = static_cast<size_t>(n);
    return impl == 1 ? infinity_sums::crc32c_scalar(crc, buf, len) : infinity_sums::crc32c(crc, buf, len);
}

void infinity_aio_crc32c_blocks(const void *buf, int64_t count, uint32_t *out) {
    if (buf && out && count > 0) infinity_sums::crc32c_blocks(buf, static_cast<size_t>(count), out);
}

int infinity_aio_crc32c_hardware(void) { return infinity_sums::crc32c_hardware(); }

}  // extern "C"
