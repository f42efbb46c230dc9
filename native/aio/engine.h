// The I/O engine of native/aio: requests cut into pieces, the two backends that move them
// (io_uring rings, a pread/pwrite pool), and what the engine's parts share. Internal to
// native/aio, as sums.h is; the C ABI over it is declared in infinity_aio.h.
//
// The library is split by job, as liburing keeps setup, queue and register apart:
//   aio.cpp     the C ABI of handles and block-sum tables (argument checks, no exception
//               crossing the ABI);
//   engine.cpp  the engine: planning, the queue, both backends, completion;
//   faults.cpp  test-only fault injection (the rules, and what they do to a piece);
//   memory.cpp  aligned host memory: mapping, releasing and measuring pages;
//   sums.cpp    CRC32C and the block-sum tables (sums.h).
#ifndef INFINITY_AIO_ENGINE_H
#define INFINITY_AIO_ENGINE_H

#include "infinity_aio.h"
#include "sums.h"

#include <errno.h>
#include <stdint.h>

#include <atomic>
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

namespace infinity_aio_impl {

constexpr int64_t kAlign = 4096;

inline int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }
inline int64_t round_down(int64_t x, int64_t a) { return x / a * a; }
inline bool aligned(const void *p) { return reinterpret_cast<uintptr_t>(p) % kAlign == 0; }

struct Request;

// A fault injected into one piece (test-only; see infinity_aio_inject and faults.cpp).
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

// Fault injection (faults.cpp). The fault the armed rules give this piece, counting it
// (kind 0: none).
Fault match_fault(const Piece &p, int op);
// Before an attempt: true when the attempt is not to be made, its result in *res; may
// shorten the attempt to *n bytes.
bool fault_before(Piece *p, int64_t *res, int64_t *n);
// After a piece has landed: FLIP and ZERO corrupt what was read (in memory) or written (in
// the file, through the buffered descriptor; ZERO punches a hole where it can).
void fault_after(Piece *p, char *data);

// Bounce buffers of one worker: reused, never shared between threads.
class BouncePool {
  public:
    explicit BouncePool(int64_t size) : size_(size) {}
    ~BouncePool();
    char *get();
    void put(char *p);

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

}  // namespace infinity_aio_impl

#endif
