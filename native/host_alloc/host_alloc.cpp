// torch's CPU allocator for the blocks that set a training step's host peak.
//
// Note [block cache]: glibc serves torch's large CPU tensors (activations, autograd's
// gradients) either from its heap arenas, which keep their freed pages and fragment over a
// step (the heap held 2.3-2.5 GiB at the peak with 0.4-1.6 GiB in use, GPT-2 124M), or, with
// a fixed mmap threshold, from fresh mappings, which return their pages when freed but are
// zeroed by the kernel again at every allocation (1.3M page faults a step, 1.1-1.4x the
// step). This allocator keeps what is good in each: every block of ``min_bytes`` or more is a
// mapping of its own (2 MiB-aligned and advised for huge pages when large enough), and a
// freed block is kept whole and handed to the next request of its size, up to a slack of an
// eighth; it is never split or merged, so no block pins pages of another. The freed blocks
// are bounded twice: before a new mapping, freed blocks of at least its size are unmapped,
// oldest first, so a miss never grows the process while freed blocks wait; and at most
// ``cache_cap`` bytes of them are kept (zero.host_allocator: release keeps 256 MiB, so the
// activations freed through backward go back to the system while the gradients and the
// optimizer's buffers fill up, and the next forward faults them in again, in 2 MiB pages).
// Smaller requests go to the allocator that was installed before.
//
// Installed process-wide by ``install`` (c10::SetCPUAllocator), restored by ``uninstall``;
// blocks outlive either: their deleter is a static function and the table is never freed.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <pybind11/pybind11.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHuge = 2u << 20;

struct Block {
  void* base;     // the mapping, where the data starts
  size_t mapped;  // bytes of the mapping
  size_t size;    // usable bytes from the data pointer
};

using FreeList = std::list<Block>;

struct State {
  std::mutex mu;
  std::unordered_map<void*, Block> live;                       // data pointer -> its block
  FreeList free_order;                                         // freed blocks, oldest first
  std::multimap<size_t, FreeList::iterator> free_by_size;      // usable size -> its freed block
  size_t live_bytes = 0, free_bytes = 0, peak_bytes = 0;
  uint64_t hits = 0, misses = 0, maps = 0, unmaps = 0, forwarded = 0;
  size_t min_bytes = 1u << 20;
  size_t cache_cap = SIZE_MAX;  // free bytes kept at most
  bool huge = true;
};

State& state() {
  static State* s = new State();  // never destroyed: blocks may be freed at interpreter exit
  return *s;
}

c10::Allocator* g_previous = nullptr;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

void unmap(const Block& b) { munmap(b.base, b.mapped); }

Block map_block(size_t size) {
  size_t bytes = round_up(size, kPage);
  bool huge = state().huge && bytes >= kHuge;
  size_t reserve = huge ? bytes + kHuge : bytes;
  void* p = mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  if (!huge) return {p, bytes, bytes};
  uintptr_t start = reinterpret_cast<uintptr_t>(p), aligned = round_up(start, kHuge);
  if (aligned > start) munmap(p, aligned - start);
  size_t tail = start + reserve - (aligned + bytes);
  if (tail) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  void* a = reinterpret_cast<void*>(aligned);
  madvise(a, bytes, MADV_HUGEPAGE);
  return {a, bytes, bytes};
}

// Callers hold the lock. Takes a freed block out of the cache and returns it.
Block take_free(std::multimap<size_t, FreeList::iterator>::iterator by_size) {
  State& s = state();
  Block b = *by_size->second;
  s.free_order.erase(by_size->second);
  s.free_by_size.erase(by_size);
  s.free_bytes -= b.size;
  return b;
}

void release_free(size_t at_least) {
  State& s = state();
  size_t released = 0;
  while (released < at_least && !s.free_order.empty()) {
    FreeList::iterator oldest = s.free_order.begin();
    auto range = s.free_by_size.equal_range(oldest->size);
    auto it = range.first;
    while (it->second != oldest) ++it;  // it is in the range: every freed block has its entry
    Block b = take_free(it);
    unmap(b);
    released += b.size;
    ++s.unmaps;
  }
}

bool installed();

// A pointer that is not one of our blocks came from the previous allocator: a small request
// freed through ``raw_deleter`` (c10's raw_allocate / raw_deallocate, which oneDNN's bf16
// matmuls use for their scratch buffers) reaches this function, not the deleter of the
// DataPtr it was allocated with. Dropping it would leak every such buffer.
void delete_block(void* p) {
  if (!p) return;
  State& s = state();
  std::unique_lock<std::mutex> g(s.mu);
  auto it = s.live.find(p);
  if (it == s.live.end()) {
    ++s.forwarded;
    g.unlock();
    g_previous->raw_deleter()(p);
    return;
  }
  Block b = it->second;
  s.live.erase(it);
  s.live_bytes -= b.size;
  if (!installed()) {  // uninstalled: nothing will reuse it
    unmap(b);
    ++s.unmaps;
    return;
  }
  s.free_by_size.emplace(b.size, s.free_order.insert(s.free_order.end(), b));
  s.free_bytes += b.size;
  if (s.free_bytes > s.cache_cap) release_free(s.free_bytes - s.cache_cap);
}

struct BlockAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    State& s = state();
    if (n < s.min_bytes) return g_previous->allocate(n);
    size_t want = round_up(n, kPage);
    void* p = nullptr;
    std::lock_guard<std::mutex> g(s.mu);
    auto it = s.free_by_size.lower_bound(want);
    if (it != s.free_by_size.end() && it->first <= want + want / 8) {
      Block b = take_free(it);
      p = b.base;
      s.live[p] = b;
      s.live_bytes += b.size;
      ++s.hits;
    } else {
      if (s.free_bytes) release_free(want);
      Block b = map_block(want);
      p = static_cast<char*>(b.base);
      s.live[p] = b;
      s.live_bytes += b.size;
      ++s.misses;
      ++s.maps;
    }
    if (s.live_bytes + s.free_bytes > s.peak_bytes) s.peak_bytes = s.live_bytes + s.free_bytes;
    return {p, p, &delete_block, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

BlockAllocator g_allocator;

bool installed() { return c10::GetCPUAllocator() == &g_allocator; }

// Settings apply to the blocks allocated from now on; true when it was not serving before.
bool install(size_t min_bytes, bool huge, size_t cache_cap) {
  State& s = state();
  {
    std::lock_guard<std::mutex> g(s.mu);
    s.min_bytes = min_bytes;
    s.huge = huge;
    s.cache_cap = cache_cap;
    if (s.free_bytes > cache_cap) release_free(s.free_bytes - cache_cap);
  }
  if (installed()) return false;
  g_previous = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&g_allocator, /*priority=*/UINT8_MAX);
  return true;
}

bool uninstall() {
  if (!installed()) return false;
  c10::SetCPUAllocator(g_previous, /*priority=*/UINT8_MAX);
  return true;
}

size_t release_cached() {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  size_t n = s.free_bytes;
  release_free(SIZE_MAX);
  return n;
}

pybind11::dict stats() {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mu);
  pybind11::dict d;
  d["installed"] = installed();
  d["live_bytes"] = s.live_bytes;
  d["cached_bytes"] = s.free_bytes;
  d["peak_bytes"] = s.peak_bytes;
  d["live_blocks"] = s.live.size();
  d["cached_blocks"] = s.free_order.size();
  d["hits"] = s.hits;
  d["misses"] = s.misses;
  d["maps"] = s.maps;
  d["unmaps"] = s.unmaps;
  d["forwarded"] = s.forwarded;
  d["min_bytes"] = s.min_bytes;
  d["cache_cap"] = s.cache_cap;
  return d;
}

// c10's raw interface of the installed CPU allocator, as oneDNN uses it: ``count`` buffers of
// ``bytes`` each, written and freed one after the other (tests/unit/test_block_cache.py).
void raw_round_trip(size_t count, size_t bytes) {
  c10::Allocator* a = c10::GetCPUAllocator();
  for (size_t i = 0; i < count; ++i) {
    void* p = a->raw_allocate(bytes);
    std::memset(p, 1, bytes);
    a->raw_deallocate(p);
  }
}

}  // namespace

PYBIND11_MODULE(_host_alloc, m) {
  m.doc() = "Note [block cache]: torch's CPU allocator for large blocks (native/host_alloc/host_alloc.cpp)";
  m.def("install", &install, pybind11::arg("min_bytes"), pybind11::arg("huge") = true,
        pybind11::arg("cache_cap") = SIZE_MAX);
  m.def("uninstall", &uninstall);
  m.def("release_cached", &release_cached);
  m.def("stats", &stats);
  m.def("raw_round_trip", &raw_round_trip, pybind11::arg("count"), pybind11::arg("bytes"));
}
