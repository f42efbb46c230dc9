// Aligned host memory (infinity_aio_alloc and its kin in infinity_aio.h): anonymous mappings
// aligned to 4 KiB or to 2 MiB and advised for huge pages, their pages given back to the
// kernel while the mapping stays, and the bytes of a range resident now.

#include "engine.h"

#include <errno.h>
#include <sys/mman.h>

#include <algorithm>
#include <vector>

using infinity_aio_impl::aligned;
using infinity_aio_impl::kAlign;
using infinity_aio_impl::round_up;

namespace {

constexpr int64_t kHuge = 2 << 20;

}  // namespace

extern "C" {

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
