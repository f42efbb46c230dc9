// Test-only fault injection at the I/O layer (infinity_aio_inject in infinity_aio.h), inert
// unless armed: rules keyed by file (device, inode) and direction count the pieces the engine
// begins, and give the chosen ones a fault that fails, shortens, stalls or corrupts them.
// The engine asks match_fault when a piece begins, fault_before before each attempt and
// fault_after when the piece has landed (engine.h).

#include "engine.h"

#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

namespace infinity_aio_impl {

namespace {

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

}  // namespace

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

}  // namespace infinity_aio_impl

using namespace infinity_aio_impl;

extern "C" {

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

}  // extern "C"
