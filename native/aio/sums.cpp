// CRC32C and the block-sum table of a swap file (Note [block sums] in sums.h).
#include "sums.h"

#include <string.h>

#include <algorithm>
#include <new>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define INFINITY_SUMS_X86 1
#endif

namespace infinity_sums {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC32C, reflected

// Slicing-by-8 tables of the scalar path, built once on first use.
struct Tables {
    uint32_t t[8][256];
    Tables() {
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
            t[0][i] = c;
        }
        for (uint32_t i = 0; i < 256; ++i)
            for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
};

const Tables &tables() {
    static const Tables tb;
    return tb;
}

uint32_t scalar_raw(uint32_t c, const unsigned char *p, size_t n) {
    const Tables &tb = tables();
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;
        c = tb.t[7][w & 0xFF] ^ tb.t[6][(w >> 8) & 0xFF] ^ tb.t[5][(w >> 16) & 0xFF] ^
            tb.t[4][(w >> 24) & 0xFF] ^ tb.t[3][(w >> 32) & 0xFF] ^ tb.t[2][(w >> 40) & 0xFF] ^
            tb.t[1][(w >> 48) & 0xFF] ^ tb.t[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ tb.t[0][(c ^ *p++) & 0xFF];
    return c;
}

#ifdef INFINITY_SUMS_X86
__attribute__((target("sse4.2"))) uint32_t hw_raw(uint32_t c, const unsigned char *p, size_t n) {
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c64 = _mm_crc32_u64(c64, w);
        p += 8;
        n -= 8;
    }
    c = static_cast<uint32_t>(c64);
    while (n--) c = _mm_crc32_u8(c, *p++);
    return c;
}

// Three blocks at a time: the instruction's latency is three cycles and its throughput one
// per cycle, so three independent streams keep it busy (each block has its own sum anyway).
__attribute__((target("sse4.2"))) void hw_blocks(const unsigned char *p, size_t count, uint32_t *out) {
    size_t i = 0;
    for (; i + 3 <= count; i += 3) {
        const unsigned char *a = p + i * kBlock, *b = a + kBlock, *c = b + kBlock;
        uint64_t x = 0xFFFFFFFFu, y = 0xFFFFFFFFu, z = 0xFFFFFFFFu;
        for (int64_t k = 0; k < kBlock; k += 8) {
            uint64_t u, v, w;
            memcpy(&u, a + k, 8);
            memcpy(&v, b + k, 8);
            memcpy(&w, c + k, 8);
            x = _mm_crc32_u64(x, u);
            y = _mm_crc32_u64(y, v);
            z = _mm_crc32_u64(z, w);
        }
        out[i] = ~static_cast<uint32_t>(x);
        out[i + 1] = ~static_cast<uint32_t>(y);
        out[i + 2] = ~static_cast<uint32_t>(z);
    }
    for (; i < count; ++i) out[i] = ~hw_raw(0xFFFFFFFFu, p + i * kBlock, kBlock);
}

bool cpu_has_sse42() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2");
}
#endif

const bool kHardware =
#ifdef INFINITY_SUMS_X86
    cpu_has_sse42();
#else
    false;
#endif

}  // namespace

uint32_t crc32c_scalar(uint32_t crc, const void *data, size_t n) {
    return ~scalar_raw(~crc, static_cast<const unsigned char *>(data), n);
}

uint32_t crc32c(uint32_t crc, const void *data, size_t n) {
#ifdef INFINITY_SUMS_X86
    if (kHardware) return ~hw_raw(~crc, static_cast<const unsigned char *>(data), n);
#endif
    return crc32c_scalar(crc, data, n);
}

int crc32c_hardware() { return kHardware ? 1 : 0; }

void crc32c_blocks(const void *data, size_t count, uint32_t *out) {
    const auto *p = static_cast<const unsigned char *>(data);
#ifdef INFINITY_SUMS_X86
    if (kHardware) {
        hw_blocks(p, count, out);
        return;
    }
#endif
    for (size_t i = 0; i < count; ++i) out[i] = crc32c_scalar(0, p + i * kBlock, kBlock);
}

// ---------------------------------------------------------------------------- the table

Table::Table(int64_t capacity_bytes)
    : leaves_n_(std::max<int64_t>(1, (capacity_bytes + kLeafBlocks * kBlock - 1) / (kLeafBlocks * kBlock))),
      leaves_(new std::atomic<std::atomic<uint64_t> *>[static_cast<size_t>(leaves_n_)]) {
    for (int64_t i = 0; i < leaves_n_; ++i) leaves_[i].store(nullptr);
}

Table::~Table() {
    for (int64_t i = 0; i < leaves_n_; ++i) delete[] leaves_[i].load();
}

std::atomic<uint64_t> *Table::leaf(int64_t block, bool make) {
    const int64_t i = block / kLeafBlocks;
    if (block < 0 || i >= leaves_n_) return nullptr;
    std::atomic<uint64_t> *l = leaves_[i].load(std::memory_order_acquire);
    if (l || !make) return l;
    auto *fresh = new (std::nothrow) std::atomic<uint64_t>[kLeafBlocks];
    if (!fresh) return nullptr;
    for (int64_t k = 0; k < kLeafBlocks; ++k) fresh[k].store(0, std::memory_order_relaxed);
    if (leaves_[i].compare_exchange_strong(l, fresh, std::memory_order_acq_rel)) {
        leaf_bytes_.fetch_add(kLeafBlocks * static_cast<int64_t>(sizeof(uint64_t)));
        return fresh;
    }
    delete[] fresh;  // another thread made it first: `l` holds theirs
    return l;
}

uint64_t Table::get(int64_t block) const {
    const int64_t i = block / kLeafBlocks;
    if (block < 0 || i >= leaves_n_) return 0;
    std::atomic<uint64_t> *l = leaves_[i].load(std::memory_order_acquire);
    return l ? l[block % kLeafBlocks].load(std::memory_order_acquire) : 0;
}

bool Table::set(int64_t block, uint64_t entry) {
    std::atomic<uint64_t> *l = leaf(block, entry != 0);
    if (!l) return entry == 0;
    l[block % kLeafBlocks].store(entry, std::memory_order_release);
    return true;
}

bool Table::exchange(int64_t block, uint64_t &expected, uint64_t entry) {
    std::atomic<uint64_t> *l = leaf(block, true);
    if (!l) return true;  // nothing stored, nothing to race with
    return l[block % kLeafBlocks].compare_exchange_strong(expected, entry, std::memory_order_acq_rel);
}

// ---------------------------------------------------------------------------- record / verify

namespace {
constexpr int64_t kBatch = 64;  // whole blocks summed per call of crc32c_blocks
}

void record(Table *t, const char *data, int64_t off, int64_t len) {
    const int64_t end = off + len;
    int64_t pos = off;
    uint32_t sums[kBatch];
    while (pos < end) {
        const int64_t k = pos / kBlock, base = k * kBlock, s = pos - base;
        const char *d = data + (pos - off);
        if (s == 0 && end - pos >= kBlock) {  // a run of whole blocks
            const int64_t m = std::min<int64_t>((end - pos) / kBlock, kBatch);
            crc32c_blocks(d, static_cast<size_t>(m), sums);
            for (int64_t i = 0; i < m; ++i)
                if (!t->set(k + i, Table::pack(sums[i], kBlock))) t->unrecorded.fetch_add(1);
            pos += m * kBlock;
            continue;
        }
        const int64_t e = std::min(end - base, kBlock);
        if (s == 0) {  // a prefix: the sum now covers it (what lay past it is no longer vouched for)
            if (!t->set(k, Table::pack(crc32c(0, d, static_cast<size_t>(e)), e))) t->unrecorded.fetch_add(1);
        } else {  // continues the covered prefix exactly, or the block's sum is no longer known
            uint64_t old = t->get(k);
            for (;;) {
                const uint64_t now = Table::len_of(old) == s
                                         ? Table::pack(crc32c(Table::crc_of(old), d, static_cast<size_t>(e - s)), e)
                                         : 0;
                if (t->exchange(k, old, now)) break;
            }
        }
        pos = base + e;
    }
}

int64_t verify(Table *t, const char *data, int64_t off, int64_t len, int64_t *bad_len) {
    const int64_t end = off + len;
    int64_t pos = off;
    uint32_t sums[kBatch];
    while (pos < end) {
        const int64_t k = pos / kBlock, base = k * kBlock, s = pos - base;
        const char *d = data + (pos - off);
        if (s == 0 && end - pos >= kBlock) {
            const int64_t m = std::min<int64_t>((end - pos) / kBlock, kBatch);
            crc32c_blocks(d, static_cast<size_t>(m), sums);
            for (int64_t i = 0; i < m; ++i) {
                const uint64_t e = t->get(k + i);
                const int64_t l = Table::len_of(e);
                if (l == 0) continue;
                const uint32_t got = l == kBlock ? sums[i] : crc32c(0, d + i * kBlock, static_cast<size_t>(l));
                if (got != Table::crc_of(e)) {
                    t->mismatches.fetch_add(1);
                    *bad_len = l;
                    return (k + i) * kBlock;
                }
            }
            pos += m * kBlock;
            continue;
        }
        const int64_t e_in = std::min(end - base, kBlock);
        const uint64_t e = t->get(k);
        const int64_t l = Table::len_of(e);
        // Only a read from the block's start that covers the whole summed prefix can be
        // checked; the planner widens partial reads of summed blocks so that they do.
        if (l > 0 && s == 0 && e_in >= l && crc32c(0, d, static_cast<size_t>(l)) != Table::crc_of(e)) {
            t->mismatches.fetch_add(1);
            *bad_len = l;
            return base;
        }
        pos = base + e_in;
    }
    return -1;
}

}  // namespace infinity_sums
