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

#include "sums.h"

#include "infinity_aio.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <new>
#include <set>
#include <system_error>
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

// A fault injected into one piece (test-only; see infinity_aio_inject).
struct Fault {
    int kind = 0;
    int64_t arg = 0;
    bool short_hit = false;  // SHORT: the shortened attempt was made; the next one finds EOF
};

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
    int64_t skip;  // widened read: bytes of the bounce buffer before the caller's part
    int64_t want;  // bytes of the caller's memory this piece fills
    Fault fault;

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
    infinity_sums::Table *sums = nullptr;
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

// ---------------------------------------------------------------------------- fault injection

struct Rule {
    uint64_t dev, ino;
    int op;
    int64_t nth, count;
    int kind;
    int64_t arg;
    int64_t seen = 0, hits = 0;
};

std::mutex g_rules_mu;
std::vector<Rule> g_rules;
std::atomic<bool> g_armed{false};

// The fault the rules give this piece, counting it (kind 0: none).
Fault match_fault(const Piece &p, int op) {
    Fault f;
    if (!g_armed.load(std::memory_order_relaxed)) return f;
    struct stat st;
    if (fstat(p.fd, &st) != 0) return f;
    std::lock_guard<std::mutex> lk(g_rules_mu);
    for (Rule &rule : g_rules) {
        if (rule.dev != static_cast<uint64_t>(st.st_dev) || rule.ino != static_cast<uint64_t>(st.st_ino) ||
            rule.op != op)
            continue;
        const int64_t n = ++rule.seen;
        if (n >= rule.nth && (rule.count <= 0 || n < rule.nth + rule.count) && f.kind == 0) {
            ++rule.hits;
            f.kind = rule.kind;
            f.arg = rule.arg;
        }
    }
    return f;
}

// Before an attempt: true when the attempt is not to be made, its result in *res; may
// shorten the attempt to *n bytes.
bool fault_before(Piece *p, int64_t *res, int64_t *n) {
    Fault &f = p->fault;
    switch (f.kind) {
    case INFINITY_AIO_FAULT_ERRNO:
        *res = -f.arg;
        return true;
    case INFINITY_AIO_FAULT_STALL:
        std::this_thread::sleep_for(std::chrono::milliseconds(f.arg));
        f.kind = 0;
        return false;
    case INFINITY_AIO_FAULT_SHORT:
        if (f.short_hit) {
            *res = 0;
            return true;
        }
        f.short_hit = true;
        *n = std::max<int64_t>(0, std::min(*n, f.arg));
        if (*n == 0) {
            *res = 0;
            return true;
        }
        return false;
    default:
        return false;
    }
}

// After a piece has landed: FLIP and ZERO corrupt what was read (in memory) or written (in
// the file, through the buffered descriptor; ZERO punches a hole where it can).
void fault_after(Piece *p, char *data) {
    Fault &f = p->fault;
    const bool read = p->req->op == INFINITY_AIO_READ;
    if (f.kind == INFINITY_AIO_FAULT_FLIP) {
        const int64_t at = std::min(std::max<int64_t>(f.arg, 0), p->len - 1);
        if (read) {
            data[at] ^= 1;
        } else {
            char c;
            if (pread(p->fd_alt, &c, 1, p->off + at) == 1) {
                c ^= 1;
                (void)!pwrite(p->fd_alt, &c, 1, p->off + at);
            }
        }
    } else if (f.kind == INFINITY_AIO_FAULT_ZERO) {
        if (read) {
            memset(data, 0, static_cast<size_t>(p->len));
        } else if (fallocate(p->fd_alt, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, p->off, p->len) != 0) {
            std::vector<char> zeros(static_cast<size_t>(p->len), 0);
            (void)!pwrite(p->fd_alt, zeros.data(), zeros.size(), p->off);
        }
    }
    f.kind = 0;
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

    int64_t submit(int op, int fd_direct, int fd_buffered, char *buf, int64_t len, int64_t off,
                   infinity_sums::Table *sums);
    int rw(int op, int fd_direct, int fd_buffered, char *buf, int64_t len, int64_t off,
           infinity_sums::Table *sums, infinity_aio_error *err);
    int ring_error() const { return ring_error_.load(); }
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
    void fail_at(Piece *p, int err, int64_t off, int64_t len, int64_t transferred);
    bool landed(Piece *p);
    void threads_loop(void *);
    void run_worker(void (Engine::*loop)(void *), void *arg);
#ifndef INFINITY_AIO_NO_URING
    void uring_loop(void *ring);
    void ring_entered(int rc, int &failures);
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
    std::atomic<int> ring_error_{0};
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

bool valid_rw(int op, int fd_direct, int fd_buffered, const void *buf, int64_t len, int64_t off) {
    if (op != INFINITY_AIO_READ && op != INFINITY_AIO_WRITE) return false;
    if (fd_buffered < 0 || fd_direct < -1 || len < 0 || off < 0) return false;
    return buf != nullptr || len == 0;
}


// Runs an entry point's body with no C++ exception crossing the C ABI: out of memory is
// -ENOMEM, a failure of the system (std::thread when the thread limit is reached) its errno.
template <class F>
auto guarded(F body) -> decltype(body()) {
    try {
        return body();
    } catch (const std::bad_alloc &) {
        return -ENOMEM;
    } catch (const std::system_error &e) {
        return e.code().value() > 0 ? -e.code().value() : -EIO;
    } catch (...) {
        return -EIO;
    }
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

int infinity_aio_inject(uint64_t dev, uint64_t ino, int32_t op, int64_t nth, int64_t count, int32_t fault,
                        int64_t arg) {
    if ((op != INFINITY_AIO_READ && op != INFINITY_AIO_WRITE) || nth < 1 || fault < INFINITY_AIO_FAULT_ERRNO ||
        fault > INFINITY_AIO_FAULT_ZERO || arg < 0 || (fault == INFINITY_AIO_FAULT_ERRNO && arg == 0))
        return -EINVAL;
    return guarded([&]() -> int {
        std::lock_guard<std::mutex> lk(g_rules_mu);
        g_rules.push_back(Rule{dev, ino, op, nth, count, fault, arg});
        g_armed.store(true);
        return static_cast<int>(g_rules.size() - 1);
    });
}

int64_t infinity_aio_inject_hits(int32_t rule) {
    std::lock_guard<std::mutex> lk(g_rules_mu);
    return rule >= 0 && static_cast<size_t>(rule) < g_rules.size() ? g_rules[static_cast<size_t>(rule)].hits : -EINVAL;
}

void infinity_aio_inject_clear(void) {
    std::lock_guard<std::mutex> lk(g_rules_mu);
    g_armed.store(false);
    g_rules.clear();
}

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

int64_t infinity_aio_release(void *p, int64_t bytes, int64_t align) {
    if (!p || bytes <= 0 || align < kAlign || align % kAlign) return -EINVAL;
    const int64_t start = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
    const int64_t first = round_up(start, align), last = (start + bytes) / align * align;
    if (last <= first) return 0;
    if (madvise(reinterpret_cast<void *>(first), static_cast<size_t>(last - first), MADV_DONTNEED) != 0) return -errno;
    return last - first;
}

int64_t infinity_aio_resident(void *p, int64_t bytes) {
    if (!p || bytes < 0 || !aligned(p)) return -EINVAL;
    const int64_t pages = round_up(bytes, kAlign) / kAlign;
    std::vector<unsigned char> vec(static_cast<size_t>(pages));
    if (pages && mincore(p, static_cast<size_t>(bytes), vec.data()) != 0) return -errno;
    int64_t in = 0;
    for (unsigned char v : vec) in += v & 1;
    return in * kAlign;
}

}  // extern "C"
