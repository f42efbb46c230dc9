// Checksums of swap-file blocks: CRC32C and the per-file table of 4 KiB block sums.
// Internal to native/aio; the C ABI over it is declared in infinity_aio.h.
#ifndef INFINITY_AIO_SUMS_H
#define INFINITY_AIO_SUMS_H

#include <stddef.h>
#include <stdint.h>

#include <atomic>
#include <memory>

namespace infinity_sums {

constexpr int64_t kBlock = 4096;

// CRC32C (Castagnoli) of `n` bytes continuing `crc` (0 to start): the SSE4.2 instruction when
// the CPU has it (chosen once, by CPUID), else a table-driven scalar loop.
uint32_t crc32c(uint32_t crc, const void *data, size_t n);
uint32_t crc32c_scalar(uint32_t crc, const void *data, size_t n);
// 1 if crc32c uses the SSE4.2 instruction.
int crc32c_hardware();
// CRC32C of each of `count` whole 4 KiB blocks at `data` into out[0..count).
void crc32c_blocks(const void *data, size_t count, uint32_t *out);

// Note [block sums]: one entry per 4 KiB block of a file, packed in 64 bits: the CRC32C in the
// low half and, above it, the length L of the prefix of the block it covers (0: nothing known).
// Leaves of kLeafBlocks entries are allocated on first write, so a file that is never
// written costs nothing but its directory.
class Table {
  public:
    static constexpr int64_t kLeafBlocks = 16384;  // 64 MiB of file per leaf

    explicit Table(int64_t capacity_bytes);
    ~Table();
    Table(const Table &) = delete;
    Table &operator=(const Table &) = delete;

    uint64_t get(int64_t block) const;
    // false when the entry could not be stored (no memory for its leaf, or past the capacity).
    bool set(int64_t block, uint64_t entry);
    bool exchange(int64_t block, uint64_t &expected, uint64_t entry);
    int64_t capacity_bytes() const { return leaves_n_ * kLeafBlocks * kBlock; }
    int64_t leaf_bytes() const { return leaf_bytes_.load(); }
    std::atomic<int64_t> mismatches{0};
    std::atomic<int64_t> unrecorded{0};  // blocks written whose sum could not be stored

    static uint64_t pack(uint32_t crc, int64_t len) { return (static_cast<uint64_t>(len) << 32) | crc; }
    static uint32_t crc_of(uint64_t e) { return static_cast<uint32_t>(e); }
    static int64_t len_of(uint64_t e) { return static_cast<int64_t>(e >> 32); }

  private:
    std::atomic<uint64_t> *leaf(int64_t block, bool make);
    int64_t leaves_n_;
    std::unique_ptr<std::atomic<std::atomic<uint64_t> *>[]> leaves_;
    std::atomic<int64_t> leaf_bytes_{0};
};

// Records the sums of bytes [off, off + len) about to be written from `data`.
void record(Table *t, const char *data, int64_t off, int64_t len);
// Checks bytes [off, off + len) just read into `data`; returns -1 if every block with a known
// sum matches, else the file offset of the first block that does not (its covered length
// in *bad_len).
int64_t verify(Table *t, const char *data, int64_t off, int64_t len, int64_t *bad_len);

}  // namespace infinity_sums

#endif
