// infinity_aio: the request queue, the two backends (io_uring rings, a pread/pwrite pool)
// and the C ABI declared in infinity_aio.h.
//
// Note: how a request is cut into pieces.
//   A request [off, off + len) is split at 4 KiB boundaries of the file. The whole blocks
//   in the middle go through fd_direct in block_size chunks; the partial blocks at either
//   end (at most one each) go through fd_buffered, so that two requests sharing a block
//   never read-modify-write it behind each other's back: the page cache merges their bytes.
//   When the caller's memory is not aligned to the same 4 KiB phase as the file offset, the
//   middle chunks are staged through aligned bounce buffers (a copy, but still O_DIRECT).
//   A piece refused by O_DIRECT with EINVAL, or a short transfer that leaves an unaligned
//   remainder, continues through fd_buffered. A short transfer of zero bytes is an error
//   (ENODATA for reads past end of file), never a silent zero fill.

#include "infinity_aio.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <new>
#include <set>
#include <thread>
#include <vector>

#ifndef INFINITY_AIO_NO_URING
#include <liburing.h>
#endif

namespace {

constexpr int64_t kAlign = 4096;
constexpr int64_t kHuge = 2 << 20;

int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }
int64_t round_down(int64_t x, int64_t a) { return x / a * a; }
bool aligned(const void *p) { return reinterpret_cast<uintptr_t>(p) % kAlign == 0; }

struct Request;

struct Piece {
    Request *req;
    int fd;      // descriptor used for the next attempt
    int fd_alt;  // buffered descriptor of the same file
    char *mem;   // caller memory of this piece
    char *bounce;
    bool needs_bounce;
    int64_t off;
    int64_t len;
    int64_t done;

    bool direct() const { return fd != fd_alt; }
    char *target() const { return (bounce ? bounce : mem) + done; }
};

struct Request {
    int64_t id = -1;
    int op = INFINITY_AIO_READ;
    bool sync = false;
    bool finished = false;  // sync requests: set under the engine mutex
    std::atomic<int64_t> remaining{0};
    std::atomic<bool> failed{false};
    infinity_aio_error error{};
    std::vector<Piece> pieces;
    size_t next = 0;  // first piece not yet handed to a worker
};

std::vector<Piece> plan(Request *r, int fd_direct, int fd_buffered, char *buf, int64_t len,
                        int64_t off, int64_t bs) {
    std::vector<Piece> out;
    auto add = [&](int fd, int64_t a, int64_t b, bool bounce) {
        Piece p{};
        p.req = r;
        p.fd = fd;
        p.fd_alt = fd_buffered;
        p.mem = buf + (a - off);
        p.needs_bounce = bounce;
        p.off = a;
        p.len = b - a;
        out.push_back(p);
    };
    const int64_t end = off + len;
    if (fd_direct < 0) {
        for (int64_t a = off; a < end; a += bs) add(fd_buffered, a, std::min(a + bs, end), false);
        return out;
    }
    const int64_t a0 = round_up(off, kAlign), a1 = round_down(end, kAlign);
    if (a0 >= a1) {  // no whole block: all of it through the page cache
        if (len > 0) add(fd_buffered, off, end, false);
        return out;
    }
    if (off < a0) add(fd_buffered, off, a0, false);
    const bool bounce = !aligned(buf + (a0 - off));
    for (int64_t a = a0; a < a1; a += bs) add(fd_direct, a, std::min(a + bs, a1), bounce);
    if (a1 < end) add(fd_buffered, a1, end, false);
    return out;
}

// Bounce buffers of one worker: reused, never shared between threads.
class BouncePool {
  public:
    explicit BouncePool(int64_t size) : size_(size) {}
    ~BouncePool() {
        for (char *p : free_) ::free(p);
    }
    char *get() {
        if (!free_.empty()) {
            char *p = free_.back();
            free_.pop_back();
            return p;
        }
        void *p = nullptr;
        return posix_memalign(&p, kAlign, size_) == 0 ? static_cast<char *>(p) : nullptr;
    }
    void put(char *p) {
        // Keep a few for reuse; a burst of misaligned requests must not pin qd * bs for good.
        if (free_.size() < kKeep)
            free_.push_back(p);
        else
            ::free(p);
    }

  private:
    static constexpr size_t kKeep = 4;
    int64_t size_;
    std::vector<char *> free_;
};

class Engine {
  public:
    Engine(int backend, int64_t bs, int qd, int threads)
        : backend_(backend), bs_(bs), qd_(qd), threads_(threads) {}
    ~Engine() { stop(); }

    int start(char *why, size_t why_len);
    void stop();
    int backend() const { return backend_; }

    int64_t submit(int op, int fd_direct, int fd_buffered, char *buf, int64_t len, int64_t off);
    int rw(int op, int fd_direct, int fd_buffered, char *buf, int64_t len, int64_t off,
           infinity_aio_error *err);
    int64_t wait(infinity_aio_error *errs, int max_errs, int *n_errs, int64_t *horizon);
    bool wait_for(int64_t timeout_ms);
    int64_t in_flight() {
        std::lock_guard<std::mutex> lk(mu_);
        return static_cast<int64_t>(incomplete_.size());
    }
    int64_t in_flight_ids(int64_t *ids, int64_t max_ids) {
        std::lock_guard<std::mutex> lk(mu_);
        int64_t i = 0;
        for (auto it = incomplete_.begin(); it != incomplete_.end() && i < max_ids; ++it) ids[i++] = *it;
        return static_cast<int64_t>(incomplete_.size());
    }
    int64_t direct_fallbacks() const { return fallbacks_.load(); }

  private:
    void enqueue(Request *r);
    size_t take(size_t max, std::vector<Piece *> &out);  // caller holds mu_
    bool begin(Piece *p, BouncePool &pool);
    bool on_result(Piece *p, int64_t res);
    void finish(Piece *p, BouncePool &pool);
    void fail(Piece *p, int err);
    void threads_loop();
#ifndef INFINITY_AIO_NO_URING
    void uring_loop(struct io_uring *ring);
    std::vector<struct io_uring> rings_;
#endif

    int backend_;
    int64_t bs_;
    int qd_;
    int threads_;
    std::vector<std::thread> workers_;
    std::mutex mu_;
    std::condition_variable cv_work_;  // queue_ gained pieces, or stopping_
    std::condition_variable cv_done_;  // a request finished
    std::deque<Request *> queue_;
    std::set<int64_t> incomplete_;
    std::vector<infinity_aio_error> errors_;
    int64_t next_id_ = 0;
    int64_t completed_ = 0;
    bool stopping_ = false;
    bool started_ = false;
    std::atomic<int64_t> fallbacks_{0};
};

void Engine::enqueue(Request *r) {
    r->remaining.store(static_cast<int64_t>(r->pieces.size()));
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back(r);
    cv_work_.notify_all();
}

size_t Engine::take(size_t max, std::vector<Piece *> &out) {
    size_t n = 0;
    while (n < max && !queue_.empty()) {
        Request *r = queue_.front();
        out.push_back(&r->pieces[r->next++]);
        ++n;
        if (r->next == r->pieces.size()) queue_.pop_front();
    }
    return n;
}

int64_t Engine::submit(int op, int fd_direct, int fd_buffered, char *buf, int64_t len,
                       int64_t off) {
    auto *r = new Request();
    r->op = op;
    r->pieces = plan(r, fd_direct, fd_buffered, buf, len, off, bs_);
    {
        std::lock_guard<std::mutex> lk(mu_);
        r->id = next_id_++;
        if (r->pieces.empty()) {  // nothing to move: complete on the spot
            ++completed_;
            int64_t id = r->id;
            delete r;
            return id;
        }
        incomplete_.insert(r->id);
    }
    int64_t id = r->id;
    enqueue(r);  // r may be finished and freed by a worker from here on
    return id;
}

int Engine::rw(int op, int fd_direct, int fd_buffered, char *buf, int64_t len, int64_t off,
               infinity_aio_error *err) {
    Request r;
    r.op = op;
    r.sync = true;
    r.pieces = plan(&r, fd_direct, fd_buffered, buf, len, off, bs_);
    if (r.pieces.empty()) return 0;
    enqueue(&r);
    std::unique_lock<std::mutex> lk(mu_);
    cv_done_.wait(lk, [&] { return r.finished; });
    if (!r.failed.load()) return 0;
    if (err) *err = r.error;
    return -r.error.err;
}

int64_t Engine::wait(infinity_aio_error *errs, int max_errs, int *n_errs, int64_t *horizon) {
    std::unique_lock<std::mutex> lk(mu_);
    const int64_t target = next_id_;
    cv_done_.wait(lk, [&] { return incomplete_.empty() || *incomplete_.begin() >= target; });
    const int n = static_cast<int>(errors_.size());
    for (int i = 0; i < n && i < max_errs; ++i) errs[i] = errors_[i];
    if (n_errs) *n_errs = n;
    errors_.clear();
    if (horizon) *horizon = target;
    int64_t done = completed_;
    completed_ = 0;
    return done;
}

bool Engine::wait_for(int64_t timeout_ms) {
    std::unique_lock<std::mutex> lk(mu_);
    const int64_t target = next_id_;
    auto covered = [&] { return incomplete_.empty() || *incomplete_.begin() >= target; };
    if (timeout_ms < 0) {
        cv_done_.wait(lk, covered);
        return true;
    }
    // Capped so that now() + timeout cannot overflow the clock's representation (~31 years).
    const auto limit = std::chrono::milliseconds(std::min<int64_t>(timeout_ms, 1000000000000LL));
    return cv_done_.wait_for(lk, limit, covered);
}

// Prepares a piece for its first attempt; false if it must not be attempted at all.
bool Engine::begin(Piece *p, BouncePool &pool) {
    if (p->req->failed.load(std::memory_order_relaxed)) return false;  // sibling failed
    if (p->needs_bounce) {
        p->bounce = pool.get();
        if (!p->bounce) {
            fail(p, ENOMEM);
            return false;
        }
        if (p->req->op == INFINITY_AIO_WRITE) memcpy(p->bounce, p->mem, p->len);
    }
    return true;
}

void Engine::fail(Piece *p, int err) {
    Request *r = p->req;
    bool expected = false;
    if (!r->failed.compare_exchange_strong(expected, true)) return;  // keep the first error
    r->error.offset = p->off;
    r->error.length = p->len;
    r->error.transferred = p->done;
    r->error.err = err;
    r->error.op = r->op;
}

// Digests one attempt's result: true when the piece is finished (done or failed), false
// when it must be attempted again (see the Note at the top for the rules).
bool Engine::on_result(Piece *p, int64_t res) {
    if (res == -EINTR || res == -EAGAIN) return false;
    if (res == -EINVAL && p->direct()) {
        fallbacks_.fetch_add(1);
        p->fd = p->fd_alt;
        return false;
    }
    if (res < 0) {
        fail(p, static_cast<int>(-res));
        return true;
    }
    if (res == 0) {
        fail(p, p->req->op == INFINITY_AIO_READ ? ENODATA : EIO);
        return true;
    }
    p->done += res;
    if (p->done < p->len) {
        if (p->direct() && p->done % kAlign != 0) p->fd = p->fd_alt;
        return false;
    }
    if (p->bounce && p->req->op == INFINITY_AIO_READ) memcpy(p->mem, p->bounce, p->len);
    return true;
}

void Engine::finish(Piece *p, BouncePool &pool) {
    if (p->bounce) {
        pool.put(p->bounce);
        p->bounce = nullptr;
    }
    Request *r = p->req;
    if (r->remaining.fetch_sub(1) != 1) return;
    std::lock_guard<std::mutex> lk(mu_);
    if (r->sync) {
        r->finished = true;
    } else {
        ++completed_;
        incomplete_.erase(r->id);
        if (r->failed.load()) {
            r->error.id = r->id;
            errors_.push_back(r->error);
        }
        delete r;
    }
    cv_done_.notify_all();
}

void Engine::threads_loop() {
    BouncePool pool(bs_);
    std::vector<Piece *> got;
    for (;;) {
        got.clear();
        {
            std::unique_lock<std::mutex> lk(mu_);
            cv_work_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
            if (queue_.empty()) return;  // stopping and drained
            take(1, got);
        }
        Piece *p = got[0];
        if (begin(p, pool)) {
            for (;;) {
                ssize_t n = p->req->op == INFINITY_AIO_READ
                                ? ::pread(p->fd, p->target(), p->len - p->done, p->off + p->done)
                                : ::pwrite(p->fd, p->target(), p->len - p->done, p->off + p->done);
                if (on_result(p, n < 0 ? -static_cast<int64_t>(errno) : n)) break;
            }
        }
        finish(p, pool);
    }
}

#ifndef INFINITY_AIO_NO_URING
void prep(struct io_uring *ring, Piece *p) {
    struct io_uring_sqe *sqe = io_uring_get_sqe(ring);  // never NULL: at most qd_ in flight
    const unsigned n = static_cast<unsigned>(p->len - p->done);
    if (p->req->op == INFINITY_AIO_READ)
        io_uring_prep_read(sqe, p->fd, p->target(), n, p->off + p->done);
    else
        io_uring_prep_write(sqe, p->fd, p->target(), n, p->off + p->done);
    io_uring_sqe_set_data(sqe, p);
}

void Engine::uring_loop(struct io_uring *ring) {
    BouncePool pool(bs_);
    std::vector<Piece *> fresh, again;
    std::vector<struct io_uring_cqe *> cqes(static_cast<size_t>(qd_));
    size_t in_flight = 0;
    for (;;) {
        fresh.clear();
        {
            std::unique_lock<std::mutex> lk(mu_);
            if (in_flight == 0 && again.empty()) {
                cv_work_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
                if (queue_.empty()) return;  // stopping and drained
            }
            take(static_cast<size_t>(qd_) - in_flight - again.size(), fresh);
        }
        for (Piece *p : again) prep(ring, p);
        in_flight += again.size();
        again.clear();
        for (Piece *p : fresh) {
            if (begin(p, pool)) {
                prep(ring, p);
                ++in_flight;
            } else {
                finish(p, pool);
            }
        }
        if (in_flight == 0) continue;
        // A failed enter (EINTR, EAGAIN, EBUSY under memory pressure) is retried by the loop;
        // the pieces stay counted in flight until their completions arrive.
        io_uring_submit_and_wait(ring, 1);
        unsigned got = io_uring_peek_batch_cqe(ring, cqes.data(), static_cast<unsigned>(cqes.size()));
        for (unsigned i = 0; i < got; ++i) {
            auto *p = static_cast<Piece *>(io_uring_cqe_get_data(cqes[i]));
            int64_t res = cqes[i]->res;
            --in_flight;
            if (on_result(p, res))
                finish(p, pool);
            else
                again.push_back(p);
        }
        io_uring_cq_advance(ring, got);
    }
}
#endif

int Engine::start(char *why, size_t why_len) {
    auto say = [&](const char *fmt, auto... args) {
        if (why && why_len) snprintf(why, why_len, fmt, args...);
    };
    if (backend_ != INFINITY_AIO_THREADS) {
#ifdef INFINITY_AIO_NO_URING
        say("this build of infinity has no io_uring support (liburing.h was missing at build time)");
        if (backend_ == INFINITY_AIO_URING) return -ENOSYS;
        backend_ = INFINITY_AIO_THREADS;
#else
        rings_.resize(static_cast<size_t>(threads_));
        int rc = 0, made = 0;
        for (auto &ring : rings_) {
            unsigned flags = 0;
#ifdef IORING_SETUP_COOP_TASKRUN
            flags |= IORING_SETUP_COOP_TASKRUN;
#endif
            rc = io_uring_queue_init(static_cast<unsigned>(qd_), &ring, flags);
            if (rc == -EINVAL && flags) rc = io_uring_queue_init(static_cast<unsigned>(qd_), &ring, 0);
            if (rc < 0) break;
            ++made;
        }
        if (rc < 0) {
            for (int i = 0; i < made; ++i) io_uring_queue_exit(&rings_[static_cast<size_t>(i)]);
            rings_.clear();
            const char *hint = rc == -EPERM    ? " (kernel.io_uring_disabled, or a container policy)"
                               : rc == -ENOSYS ? " (kernel without io_uring, or a seccomp filter)"
                                               : "";
            say("io_uring_queue_init failed: %s%s", strerror(-rc), hint);
            if (backend_ == INFINITY_AIO_URING) return rc;
            backend_ = INFINITY_AIO_THREADS;
        } else {
            backend_ = INFINITY_AIO_URING;
        }
#endif
    }
    started_ = true;
#ifndef INFINITY_AIO_NO_URING
    if (backend_ == INFINITY_AIO_URING) {
        for (auto &ring : rings_) workers_.emplace_back([this, r = &ring] { uring_loop(r); });
        return 0;
    }
#endif
    // Blocking syscalls: parallelism comes from the number of threads in the pool.
    const int n = std::max(threads_, std::min(threads_ * qd_, 64));
    for (int i = 0; i < n; ++i) workers_.emplace_back([this] { threads_loop(); });
    return 0;
}

void Engine::stop() {
    if (!started_) return;
    {
        std::lock_guard<std::mutex> lk(mu_);
        stopping_ = true;
        cv_work_.notify_all();
    }
    for (auto &t : workers_) t.join();
    workers_.clear();
#ifndef INFINITY_AIO_NO_URING
    for (auto &ring : rings_) io_uring_queue_exit(&ring);
    rings_.clear();
#endif
    started_ = false;
}

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
    auto *h = new (std::nothrow) infinity_aio(backend, block_size, queue_depth, threads);
    if (!h) return -ENOMEM;
    int rc = h->engine.start(why, why_len);
    if (rc < 0) {
        delete h;
        return rc;
    }
    *out = h;
    return 0;
}

int infinity_aio_backend(const infinity_aio *h) { return h->engine.backend(); }

void infinity_aio_destroy(infinity_aio *h) { delete h; }

int64_t infinity_aio_submit(infinity_aio *h, int32_t op, int32_t fd_direct, int32_t fd_buffered,
                            void *buf, int64_t length, int64_t offset) {
    if (!valid_rw(op, fd_direct, fd_buffered, buf, length, offset)) return -EINVAL;
    return h->engine.submit(op, fd_direct, fd_buffered, static_cast<char *>(buf), length, offset);
}

int infinity_aio_rw(infinity_aio *h, int32_t op, int32_t fd_direct, int32_t fd_buffered, void *buf,
                    int64_t length, int64_t offset, infinity_aio_error *err) {
    if (!valid_rw(op, fd_direct, fd_buffered, buf, length, offset)) return -EINVAL;
    return h->engine.rw(op, fd_direct, fd_buffered, static_cast<char *>(buf), length, offset, err);
}

int64_t infinity_aio_wait(infinity_aio *h, infinity_aio_error *errs, int32_t max_errs,
                          int32_t *n_errs, int64_t *horizon) {
    return h->engine.wait(errs, max_errs, n_errs, horizon);
}

int infinity_aio_wait_for(infinity_aio *h, int64_t timeout_ms) {
    return h->engine.wait_for(timeout_ms) ? 1 : 0;
}

int64_t infinity_aio_in_flight(infinity_aio *h) { return h->engine.in_flight(); }

int64_t infinity_aio_in_flight_ids(infinity_aio *h, int64_t *ids, int64_t max_ids) {
    if (!ids) max_ids = 0;
    return h->engine.in_flight_ids(ids, max_ids);
}

int64_t infinity_aio_direct_fallbacks(infinity_aio *h) { return h->engine.direct_fallbacks(); }

void *infinity_aio_alloc(int64_t bytes, int32_t hugepage, int32_t *huge) {
    if (huge) *huge = 0;
    if (bytes < 0) return nullptr;
    const int64_t align = hugepage ? kHuge : kAlign;
    const size_t size = static_cast<size_t>(round_up(std::max<int64_t>(bytes, 1), align));
    // Over-map by one alignment unit, then trim both ends so the start is aligned.
    const size_t span = size + static_cast<size_t>(align);
    void *raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t first = static_cast<uintptr_t>(round_up(static_cast<int64_t>(start), align));
    if (first > start) munmap(raw, first - start);
    const uintptr_t tail = first + size, stop = start + span;
    if (stop > tail) munmap(reinterpret_cast<void *>(tail), stop - tail);
    void *p = reinterpret_cast<void *>(first);
#ifdef MADV_HUGEPAGE
    if (hugepage && madvise(p, size, MADV_HUGEPAGE) == 0 && huge) *huge = 1;
#endif
    return p;
}

void infinity_aio_free(void *p, int64_t bytes, int32_t hugepage) {
    if (!p) return;
    const int64_t align = hugepage ? kHuge : kAlign;
    munmap(p, static_cast<size_t>(round_up(std::max<int64_t>(bytes, 1), align)));
}

}  // extern "C"
