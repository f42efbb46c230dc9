// The I/O engine of native/aio (engine.h): requests planned into pieces, queued, moved by
// one of two backends (io_uring rings, a pread/pwrite pool), checked and completed.
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
//
// Note: checksummed requests (a block-sum table given: Note [block sums] in sums.h).
//   A write records the sums of the blocks it covers from the caller's memory in begin(),
//   on the worker thread, just before the piece is issued. A read checks the blocks of a
//   piece as soon as the piece has landed, on the worker thread that reaped it, before the
//   bytes leave a bounce buffer: the cost lands on the I/O threads, beside the transfer, not
//   on the thread that waits. A partial block can be checked only if the read covers the
//   whole prefix its sum covers, so the planner widens such a piece to that prefix (read
//   into a bounce buffer, the caller's part copied out): at most one extra 4 KiB read at
//   either end of a request, through the page cache.

#include "engine.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>

namespace infinity_aio_impl {

namespace {

// The pieces of a request (Note: how a request is cut into pieces; Note: checksummed requests).
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
        p.len = p.want = b - a;
        out.push_back(p);
    };
    const int64_t end = off + len;
    int64_t pos = off;
    if (pos % kAlign && pos < end) {  // the partial block at the start
        const int64_t e = std::min(round_up(pos, kAlign), end);
        add(fd_buffered, pos, e, false);
        pos = e;
    }
    const int64_t whole_end = std::max(pos, round_down(end, kAlign));
    const int fd = fd_direct >= 0 ? fd_direct : fd_buffered;
    const bool bounce = fd_direct >= 0 && !aligned(buf + (pos - off));
    for (int64_t a = pos; a < whole_end; a += bs) add(fd, a, std::min(a + bs, whole_end), bounce);
    if (whole_end < end) add(fd_buffered, whole_end, end, false);  // the partial block at the end
    if (r->sums && r->op == INFINITY_AIO_READ) {
        for (Piece &p : out) {  // Note: checksummed requests (widening)
            const int64_t base = round_down(p.off, kAlign), s = p.off - base, e = s + p.len;
            if (s == 0 && e % kAlign == 0) continue;  // whole blocks
            const int64_t l = infinity_sums::Table::len_of(r->sums->get(base / kAlign));
            if (l == 0 || (s == 0 && e >= l)) continue;  // nothing summed, or the read covers it
            p.skip = s;
            p.off = base;
            p.len = std::max(e, l);
            p.needs_bounce = true;
        }
    }
    return out;
}

}  // namespace

BouncePool::~BouncePool() {
    for (char *p : free_) ::free(p);
}

char *BouncePool::get() {
    if (!free_.empty()) {
        char *p = free_.back();
        free_.pop_back();
        return p;
    }
    void *p = nullptr;
    return posix_memalign(&p, kAlign, size_) == 0 ? static_cast<char *>(p) : nullptr;
}

void BouncePool::put(char *p) {
    // Keep a few for reuse; a burst of misaligned requests must not pin qd * bs for good.
    if (free_.size() < kKeep)
        free_.push_back(p);
    else
        ::free(p);
}

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
                       int64_t off, infinity_sums::Table *sums) {
    std::unique_ptr<Request> r(new Request());  // may throw: nothing is queued yet
    r->op = op;
    r->sums = sums;
    r->pieces = plan(r.get(), fd_direct, fd_buffered, buf, len, off, bs_);
    int64_t id;
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (r->pieces.empty()) {  // nothing to move: complete on the spot
            ++completed_;
            return next_id_++;
        }
        incomplete_.insert(next_id_);  // may throw before the id is taken
        id = r->id = next_id_++;
    }
    enqueue(r.release());  // may be finished and freed by a worker from here on
    return id;
}

int Engine::rw(int op, int fd_direct, int fd_buffered, char *buf, int64_t len, int64_t off,
               infinity_sums::Table *sums, infinity_aio_error *err) {
    Request r;
    r.op = op;
    r.sync = true;
    r.sums = sums;
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
    p->fault = match_fault(*p, p->req->op);
    if (p->needs_bounce) {
        p->bounce = pool.get();
        if (!p->bounce) {
            fail(p, ENOMEM);
            return false;
        }
        if (p->req->op == INFINITY_AIO_WRITE) memcpy(p->bounce, p->mem, p->len);
    }
    if (p->req->sums && p->req->op == INFINITY_AIO_WRITE)  // Note: checksummed requests
        infinity_sums::record(p->req->sums, p->mem, p->off, p->len);
    return true;
}

void Engine::fail(Piece *p, int err) { fail_at(p, err, p->off, p->len, p->done); }

void Engine::fail_at(Piece *p, int err, int64_t off, int64_t len, int64_t transferred) {
    Request *r = p->req;
    bool expected = false;
    if (!r->failed.compare_exchange_strong(expected, true)) return;  // keep the first error
    r->error.offset = off;
    r->error.length = len;
    r->error.transferred = transferred;
    r->error.err = err;
    r->error.op = r->op;
}

// A piece has moved all its bytes: injected corruption, the checksum check, and the copy out
// of a bounce buffer. False if the piece failed its check.
bool Engine::landed(Piece *p) {
    char *data = p->bounce ? p->bounce : p->mem;
    if (p->fault.kind) fault_after(p, data);
    if (p->req->sums && p->req->op == INFINITY_AIO_READ) {  // Note: checksummed requests
        int64_t bad_len = 0;
        const int64_t bad = infinity_sums::verify(p->req->sums, data, p->off, p->len, &bad_len);
        if (bad >= 0) {
            fail_at(p, EBADMSG, bad, bad_len, p->len);
            return false;
        }
    }
    if (p->bounce && p->req->op == INFINITY_AIO_READ) memcpy(p->mem, p->bounce + p->skip, p->want);
    return true;
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
    landed(p);
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

void Engine::threads_loop(void *) {
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
                int64_t res = 0, n = p->len - p->done;
                if (!fault_before(p, &res, &n)) {
                    const ssize_t got = p->req->op == INFINITY_AIO_READ
                                            ? ::pread(p->fd, p->target(), static_cast<size_t>(n), p->off + p->done)
                                            : ::pwrite(p->fd, p->target(), static_cast<size_t>(n), p->off + p->done);
                    res = got < 0 ? -static_cast<int64_t>(errno) : got;
                }
                if (on_result(p, res)) break;
            }
        }
        finish(p, pool);
    }
}

#ifndef INFINITY_AIO_NO_URING
namespace {

// Queues the next attempt of a piece; false (result in *res) when an injected fault decides
// the attempt without the kernel.
bool prep(struct io_uring *ring, Piece *p, int64_t *res) {
    int64_t n = p->len - p->done;
    if (fault_before(p, res, &n)) return false;
    struct io_uring_sqe *sqe = io_uring_get_sqe(ring);  // never NULL: at most qd_ in flight
    if (p->req->op == INFINITY_AIO_READ)
        io_uring_prep_read(sqe, p->fd, p->target(), static_cast<unsigned>(n), p->off + p->done);
    else
        io_uring_prep_write(sqe, p->fd, p->target(), static_cast<unsigned>(n), p->off + p->done);
    io_uring_sqe_set_data(sqe, p);
    return true;
}

}  // namespace

// The result of io_uring_submit_and_wait. EINTR is retried at once; any other failure
// (EAGAIN, EBUSY, ENOMEM under memory pressure, or a broken ring) pauses the thread, longer
// each time up to 100 ms, instead of spinning, and is published by infinity_aio_ring_error
// after a few in a row. The pieces stay in flight: their completions, if any come, are still
// reaped, and a caller's timed wait names the error.
void Engine::ring_entered(int rc, int &failures) {
    if (rc >= 0 || rc == -EINTR) {
        if (failures) ring_error_.store(0);
        failures = 0;
        return;
    }
    ++failures;
    if (failures >= 3 || (rc != -EAGAIN && rc != -EBUSY && rc != -ENOMEM)) ring_error_.store(rc);
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(1 << std::min(failures, 7), 100)));
}

void Engine::uring_loop(void *arg) {
    auto *ring = static_cast<struct io_uring *>(arg);
    BouncePool pool(bs_);
    std::vector<Piece *> fresh, again;
    std::vector<std::pair<Piece *, int64_t>> decided;  // attempts a fault settled without the kernel
    fresh.reserve(static_cast<size_t>(qd_));
    again.reserve(static_cast<size_t>(qd_));
    decided.reserve(static_cast<size_t>(qd_));
    std::vector<struct io_uring_cqe *> cqes(static_cast<size_t>(qd_));
    size_t in_flight = 0;
    int failures = 0;
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
        for (Piece *p : again) {
            int64_t res = 0;
            if (prep(ring, p, &res))
                ++in_flight;
            else
                decided.emplace_back(p, res);
        }
        again.clear();
        for (Piece *p : fresh) {
            if (!begin(p, pool)) {
                finish(p, pool);
                continue;
            }
            int64_t res = 0;
            if (!prep(ring, p, &res)) {
                decided.emplace_back(p, res);
                continue;
            }
            ++in_flight;
            // A checksummed write spent time summing its bytes in begin(): let the disk start
            // on it before the next piece is summed (Note: checksummed requests).
            if (p->req->sums && p->req->op == INFINITY_AIO_WRITE) ring_entered(io_uring_submit(ring), failures);
        }
        for (auto &d : decided) {
            if (on_result(d.first, d.second))
                finish(d.first, pool);
            else
                again.push_back(d.first);
        }
        decided.clear();
        if (in_flight == 0) continue;
        ring_entered(io_uring_submit_and_wait(ring, 1), failures);
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

// A worker thread's body: an exception (no memory for a bookkeeping vector) must not reach
// std::terminate; the thread reports it as a ring error and stops taking work.
void Engine::run_worker(void (Engine::*loop)(void *), void *arg) {
    try {
        (this->*loop)(arg);
    } catch (const std::bad_alloc &) {
        ring_error_.store(-ENOMEM);
    } catch (...) {
        ring_error_.store(-EIO);
    }
}

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
        for (auto &ring : rings_)
            workers_.emplace_back([this, r = &ring] { run_worker(&Engine::uring_loop, r); });
        return 0;
    }
#endif
    // Blocking syscalls: parallelism comes from the number of threads in the pool.
    const int n = std::max(threads_, std::min(threads_ * qd_, 64));
    for (int i = 0; i < n; ++i) workers_.emplace_back([this] { run_worker(&Engine::threads_loop, nullptr); });
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

}  // namespace infinity_aio_impl
